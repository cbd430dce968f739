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
from shared.streams.key_types import arun_named

CANCEL_STREAM_MAXLEN = 10_000
# how long an enqueue without a lease stays marked (keys.enqueued): far past redis-py's resend of a command (3
# tries within a second, shared.streams.client.RETRIES), short enough that a batch file's marks cost little
ENQUEUE_MARK_TTL_S = 60
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
# of its own, and never a lease without its request nor a leased request without its lease.
# Each call is marked so that the same call run again enqueues nothing: redis-py sends a command again when its
# reply was lost (Redis stopped after running it, a connection killed), and the request would go onto the stream a
# second time (or, with the blocks the first run reserved, be refused and placed on another worker). The mark is
# this call's nonce (ARGV[10]) and the entry's id, in the guard key (KEYS[4]). For a leased request that is the
# lease, which holds them until the gateway first refreshes it; it refreshes a lease only once the enqueue call
# returned, its resends included (gateway.placement.place), and a request placed again has a new id. For a request
# without a lease (services' jobs: Celery, the Python client, batch files) it is a key of its own (keys.enqueued),
# for ENQUEUE_MARK_TTL_S. The same call run again finds them and answers the same entry id; a new placement of the
# same request is a new call, so it still enqueues. (GUARD_LUA: the check, for every script that enqueues;
# shared.streams.worker's forward too.)
GUARD_LUA = """
local function done_before(guard_key, nonce)  -- the entry this same call added, if it ran already
  local held = redis.call('GET', guard_key)
  if held and string.sub(held, 1, #nonce + 1) == nonce .. ' ' then return string.sub(held, #nonce + 2) end
  return nil
end
"""
_ENQUEUE_ROUTED = LuaScript(GUARD_LUA + """
local blocks, min_headroom, queue_bound = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[7])
local guard_ms = tonumber(ARGV[8])
local done = done_before(KEYS[4], ARGV[10])
if done then return done end
-- the status and the reservations read with pcall: a key of another type (another version's or program's write)
-- is no status (refused where the room is checked) and no reservations (none written there), not a failed script
local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' then raw = false end
local function count(key)  -- a top-level integer of the status JSON, without decoding all of it: a plain find
  local at = raw and string.find(raw, key, 1, true)  -- of '"name":', then a match anchored just after it
  return at and tonumber(string.match(raw, '^%-?%d+', at + #key)) or 0
end
local vals = redis.pcall('HVALS', KEYS[2])
local reservable = vals.err == nil
if not reservable then vals = {} end
if queue_bound >= 0 and #vals + count('"waiting":') >= queue_bound then return false end
if min_headroom >= 0 then
  if not raw then return false end
  local reserved, most = 0, count('"total_blocks":')
  for _, v in ipairs(vals) do  -- a value that is not a count, or over the whole cache, counts nothing (reserved_blocks)
    if string.match(v, '^%d+$') and tonumber(v) <= most then reserved = reserved + tonumber(v) end
  end
  if count('"free_blocks":') - count('"promised_blocks":') - reserved - blocks < min_headroom then return false end
end
if blocks > 0 and reservable then
  redis.call('HSET', KEYS[2], ARGV[1], blocks)
  if #vals == 0 or ARGV[9] == '1' then redis.call('PEXPIRE', KEYS[2], ARGV[4]) end
end
local entry = redis.pcall('XADD', KEYS[3], '*', ARGV[6], ARGV[5])
if type(entry) == 'table' then  -- its stream is a key of another type: the error is the answer, nothing reserved
  if blocks > 0 and reservable then redis.call('HDEL', KEYS[2], ARGV[1]) end
  return entry
end
redis.call('SET', KEYS[4], ARGV[10] .. ' ' .. entry, 'PX', guard_ms)
return entry
""")

# Atomic "enqueue on the shared stream unless more than `bound` requests already wait there untaken" (its guard
# key, KEYS[2], as above: the lease or the mark; run again, the same entry id).
_ENQUEUE_SHARED = LuaScript(GUARD_LUA + """
local bound, guard_ms = tonumber(ARGV[1]), tonumber(ARGV[5])
local done = done_before(KEYS[2], ARGV[6])
if done then return done end
if bound >= 0 then
  local waiting = redis.call('XLEN', KEYS[1])
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[2])
  if type(pending) == 'table' and pending['err'] == nil then waiting = waiting - pending[1] end
  if waiting >= bound then return false end
end
local entry = redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[3])
redis.call('SET', KEYS[2], ARGV[6] .. ' ' .. entry, 'PX', guard_ms)
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
    elsewhere). A key of another type among its keys (the worker's stream, say) raises KeyOfAnotherType naming it,
    and nothing is reserved."""
    names = [keys.status(worker_id, shard), keys.reserved(worker_id, shard), keys.req_stream(worker_id, shard),
             _guard_key(request, shard, lease_ttl_s)]
    args = [request.request_id, request.kv_blocks, -1 if min_headroom is None else min_headroom,
            int(reservation_ttl_s * 1000), request.model_dump_json(), keys.FIELD,
            -1 if queue_bound is None else queue_bound, _guard_ms(lease_ttl_s), int(push_expiry), call_nonce()]
    return await arun_named(r, lambda: arun_script(r, _ENQUEUE_ROUTED, names, args), names)


async def aenqueue_shared(r: aioredis.Redis, request: GenerationRequest, shard: int, *, bound: int | None,
                          lease_ttl_s: float | None = None) -> str | None:
    """Enqueue on the shard's shared stream, atomically refusing (None) when `bound` requests already wait
    untaken there; with `lease_ttl_s`, the request's lease is set with it. KeyOfAnotherType names a key of
    another type (the shared stream, say)."""
    names = [keys.req_any(shard), _guard_key(request, shard, lease_ttl_s)]
    args = [-1 if bound is None else bound, keys.GROUP, request.model_dump_json(), keys.FIELD, _guard_ms(lease_ttl_s),
            call_nonce()]
    return await arun_named(r, lambda: arun_script(r, _ENQUEUE_SHARED, names, args), names)


def call_nonce() -> str:
    """One enqueue call's mark: the same in a command redis-py sends again, new in the next call."""
    return secrets.token_hex(8)


def _guard_key(request: GenerationRequest, shard: int, lease_ttl_s: float | None) -> str:
    """Where an enqueue marks its call: the request's lease, or without one a key of its own."""
    return keys.enqueued(request.request_id, shard) if lease_ttl_s is None else keys.lease(request.request_id, shard)


def _guard_ms(lease_ttl_s: float | None) -> int:
    """The guard key's TTL: the lease's, or the mark's."""
    return int(ENQUEUE_MARK_TTL_S * 1000) if lease_ttl_s is None else max(1, int(lease_ttl_s * 1000))


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
