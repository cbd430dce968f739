"""Requests into the fleet: the atomic route-reserve-enqueue on a worker's stream, the shared stream with its
bound, and cancels (a marker, so a cancel that beats its request to a worker still counts, and a stream every
worker reads)."""

from __future__ import annotations

import secrets
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.messages import GenerationRequest
from shared.streams.client import LuaScript, arun_script

CANCEL_STREAM_MAXLEN = 10_000
CANCEL_MARK_TTL_S = 3600


# ---- requests -------------------------------------------------------------------------------------

# Atomic "reserve and enqueue on a worker, if it still has the room the router saw": the status and the
# reservations are re-read inside Redis, so concurrent gateways never over-commit a worker. Whatever the
# policy, a worker with `queue_bound` requests waiting takes no more, so no stream grows without bound. The
# waiting ones are its reservations (one per request enqueued there that its status does not count yet: the
# worker's status flush deletes them as it counts them) plus its status' `waiting` (taken, not started): the
# same HVALS serves both checks, with no XLEN or XPENDING of the stream. The status' three counts are found in
# its JSON, not decoded with it (a key's quotes cannot occur inside a JSON string: there they are escaped), by a
# plain search for the key and a match anchored after it (a pattern match tried at every position cost ~8 us of
# Redis CPU per enqueue for the three; this ~1).
# The reservations hash expires (ARGV[4] ms) unless pushed out: at its creation, and when the gateway asks
# (ARGV[9] = 1: it has not pushed it for a third of that time), not with every request.
# With a lease TTL, the request's lease (KEYS[4], shared.streams.leases) is set in the same step: no round trip
# of its own, and never a lease without its request nor a leased request without its lease. The lease holds this
# call's nonce (ARGV[10]) and the entry's id until the gateway first refreshes it: the same call run again (redis-py
# sends a command again when its reply was lost: Redis stopped after running it, a connection killed) finds them
# and answers the same entry id, where it would have enqueued the request a second time (or, with the blocks it
# reserved the first time, been refused and placed it on another worker).
_IDEMPOTENT = """
local function done_before(lease_key, nonce)  -- the entry this same call added, if it ran already
  local held = redis.call('GET', lease_key)
  if held and string.sub(held, 1, #nonce + 1) == nonce .. ' ' then return string.sub(held, #nonce + 2) end
  return nil
end
"""
_ENQUEUE_ROUTED = LuaScript(_IDEMPOTENT + """
local blocks, min_headroom, queue_bound = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[7])
local lease_ms = tonumber(ARGV[8])
if lease_ms > 0 then
  local entry = done_before(KEYS[4], ARGV[10])
  if entry then return entry end
end
local raw = redis.call('GET', KEYS[1])
local function count(key)  -- a top-level integer of the status JSON, without decoding all of it: a plain find
  local at = raw and string.find(raw, key, 1, true)  -- of '"name":', then a match anchored just after it
  return at and tonumber(string.match(raw, '^%-?%d+', at + #key)) or 0
end
local vals = redis.call('HVALS', KEYS[2])
if queue_bound >= 0 and #vals + count('"waiting":') >= queue_bound then return false end
if min_headroom >= 0 then
  if not raw then return false end
  local reserved = 0
  for _, v in ipairs(vals) do reserved = reserved + tonumber(v) end
  if count('"free_blocks":') - count('"promised_blocks":') - reserved - blocks < min_headroom then return false end
end
if blocks > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], blocks)
  if #vals == 0 or ARGV[9] == '1' then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
end
local entry = redis.call('XADD', KEYS[3], '*', ARGV[6], ARGV[5])
if lease_ms > 0 then redis.call('SET', KEYS[4], ARGV[10] .. ' ' .. entry, 'PX', lease_ms) end
return entry
""")

# Atomic "enqueue on the shared stream unless more than `bound` requests already wait there untaken" (and its
# lease, KEYS[2], as above, run again: the same entry id).
_ENQUEUE_SHARED = LuaScript(_IDEMPOTENT + """
local bound, lease_ms = tonumber(ARGV[1]), tonumber(ARGV[5])
if lease_ms > 0 then
  local entry = done_before(KEYS[2], ARGV[6])
  if entry then return entry end
end
if bound >= 0 then
  local waiting = redis.call('XLEN', KEYS[1])
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[2])
  if type(pending) == 'table' and pending['err'] == nil then waiting = waiting - pending[1] end
  if waiting >= bound then return false end
end
local entry = redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[3])
if lease_ms > 0 then redis.call('SET', KEYS[2], ARGV[6] .. ' ' .. entry, 'PX', lease_ms) end
return entry
""")


def enqueue_commands(pipe: Any, request: GenerationRequest, worker_id: str | None, shard: int,
                     *, reservation_ttl_s: float = 30.0) -> None:
    """Queue on `pipe` (sync or async pipeline): the reservation of the request's blocks on the chosen
    worker, then the XADD to its stream (the shard's shared stream when `worker_id` is None). No capacity
    checks."""
    if worker_id is not None and request.kv_blocks > 0:
        pipe.hset(keys.reserved(worker_id, shard), request.request_id, request.kv_blocks)
        pipe.pexpire(keys.reserved(worker_id, shard), int(reservation_ttl_s * 1000))
    stream = keys.req_any(shard) if worker_id is None else keys.req_stream(worker_id, shard)
    pipe.xadd(stream, {keys.FIELD: request.model_dump_json()})


def enqueue(r: redis.Redis, request: GenerationRequest, worker_id: str | None, shard: int = 0, **kw: Any) -> str:
    pipe = r.pipeline(transaction=True)
    enqueue_commands(pipe, request, worker_id, shard, **kw)
    return pipe.execute()[-1]


async def aenqueue(r: aioredis.Redis, request: GenerationRequest, worker_id: str | None, shard: int = 0,
                   **kw: Any) -> str:
    pipe = r.pipeline(transaction=True)
    enqueue_commands(pipe, request, worker_id, shard, **kw)
    return (await pipe.execute())[-1]


async def aenqueue_routed(r: aioredis.Redis, request: GenerationRequest, worker_id: str, shard: int, *,
                          min_headroom: int | None, queue_bound: int | None = None,
                          reservation_ttl_s: float = 30.0, lease_ttl_s: float | None = None,
                          push_expiry: bool = True) -> str | None:
    """Reserve `request.kv_blocks` on the worker and enqueue there, atomically; with `min_headroom` set, only
    if the worker's free blocks less queued and reserved ones still leave that many after this request; with
    `queue_bound` set, only while fewer requests than that wait for the worker (reserved there, or taken and
    not started); with `lease_ttl_s`, the request's lease is set with it. The reservations' expiry is pushed
    out to `reservation_ttl_s` when the hash is new, or with `push_expiry`. None: it cannot take it now (route
    elsewhere)."""
    return await arun_script(
        r, _ENQUEUE_ROUTED,
        [keys.status(worker_id, shard), keys.reserved(worker_id, shard), keys.req_stream(worker_id, shard),
         keys.lease(request.request_id, shard)],
        [request.request_id, request.kv_blocks, -1 if min_headroom is None else min_headroom,
         int(reservation_ttl_s * 1000), request.model_dump_json(), keys.FIELD,
         -1 if queue_bound is None else queue_bound, _lease_ms(lease_ttl_s), int(push_expiry), _nonce()])


async def aenqueue_shared(r: aioredis.Redis, request: GenerationRequest, shard: int, *, bound: int | None,
                          lease_ttl_s: float | None = None) -> str | None:
    """Enqueue on the shard's shared stream, atomically refusing (None) when `bound` requests already wait
    untaken there; with `lease_ttl_s`, the request's lease is set with it."""
    return await arun_script(r, _ENQUEUE_SHARED, [keys.req_any(shard), keys.lease(request.request_id, shard)],
                             [-1 if bound is None else bound, keys.GROUP, request.model_dump_json(), keys.FIELD,
                              _lease_ms(lease_ttl_s), _nonce()])


def _nonce() -> str:
    """One enqueue call's mark in its lease: the same in a command redis-py sends again, new in the next call."""
    return secrets.token_hex(8)


def _lease_ms(ttl_s: float | None) -> int:
    return 0 if ttl_s is None else max(1, int(ttl_s * 1000))


def parse_request(fields: dict[str, str]) -> GenerationRequest:
    return GenerationRequest.model_validate_json(fields[keys.FIELD])


# ---- cancels --------------------------------------------------------------------------------------

def cancel_commands(pipe: Any, request_id: str) -> None:
    pipe.set(keys.cancelled(request_id), 1, ex=CANCEL_MARK_TTL_S)
    pipe.xadd(keys.CANCEL, {keys.FIELD: request_id}, maxlen=CANCEL_STREAM_MAXLEN, approximate=True)


def cancel(r: redis.Redis, request_id: str) -> None:
    pipe = r.pipeline(transaction=False)
    cancel_commands(pipe, request_id)
    pipe.execute()


async def acancel(r: aioredis.Redis, request_id: str) -> None:
    pipe = r.pipeline(transaction=False)
    cancel_commands(pipe, request_id)
    await pipe.execute()
