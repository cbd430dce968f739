"""Leases on requests: a gateway holds kvfleet:{s}:lease:{request} (a short TTL) while its client waits and
refreshes all of its leases in one round trip; a worker reads the leases of the requests it holds in one
round trip, and aborts those whose lease lapsed (their gateway died: nobody reads the output)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterable, Mapping

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.streams.client import LuaScript, arun_script, out_of_memory

# Set (or refresh) the leases of one shard (KEYS) to expire in ARGV[1] ms; per lease, 1 if it was there, 0 if it
# was gone. The value marks this call (ARGV[2], a nonce) and what it found: redis-py sends a command again when its
# reply was lost (a connection killed just after Redis ran it), and the same call run again answers what its first
# run found, where a plain SET ... GET answered "there" for the lease that first run had just set, and the gateway
# never learned that Redis had lost the request.
_HOLD = LuaScript("""
local mark, out = ARGV[2] .. ' ', {}
for i, key in ipairs(KEYS) do
  local old = redis.call('GET', key)
  local was = old and '1' or '0'
  if old and string.sub(old, 1, #mark) == mark then was = string.sub(old, #mark + 1) end
  redis.call('SET', key, mark .. was, 'PX', ARGV[1])
  out[i] = tonumber(was)
end
return out
""")


async def ahold_leases(r: aioredis.Redis, request_ids: Mapping[str, int], ttl_s: float, *,
                       expire: Iterable[str] = (), expire_s: float = 0.0) -> tuple[set[str], bool]:
    """Set (or refresh) the lease of every request in `request_ids` (request id -> its shard) to expire in
    `ttl_s`: one script per shard, at once (one round trip).
    SET, not PEXPIRE, so a lease that expired while Redis was away comes back. -> (the requests whose lease
    was not there: Redis lost it (a restart without the data, a FLUSHALL), or it lapsed; whether Redis was full).
    Safe to send again (_HOLD). A full Redis (maxmemory, noeviction) refuses the SETs: the leases there are then kept
    with PEXPIRE, and those not there stay gone.
    In the same round trip, the keys in `expire` (output streams read to their end) expire in `expire_s`."""
    ms, nonce = max(1, int(ttl_s * 1000)), secrets.token_hex(8)
    by_shard: dict[int, list[str]] = {}
    for rid, shard in request_ids.items():
        by_shard.setdefault(shard, []).append(rid)
    expiring = _apexpire(r, list(expire), max(1, int(expire_s * 1000))) if expire else asyncio.sleep(0)
    found, _ = await asyncio.gather(
        asyncio.gather(*(_ahold_shard(r, ids, shard, ms, nonce) for shard, ids in by_shard.items())), expiring)
    return {rid for gone, _ in found for rid in gone}, any(full for _, full in found)


async def _ahold_shard(r: aioredis.Redis, ids: list[str], shard: int, ms: int, nonce: str) -> tuple[set[str], bool]:
    names = [keys.lease(rid, shard) for rid in ids]
    try:
        there = await arun_script(r, _HOLD, names, [ms, nonce])
    except redis.ResponseError as e:
        if not out_of_memory(e):
            raise
        # Redis is full: it refuses the SETs but takes PEXPIRE, so the leases that are there are kept (else they
        # would lapse and the workers abort what their clients wait for); one gone cannot be set again
        kept = await _apexpire(r, names, ms, raise_on_error=False)
        return {rid for rid, k in zip(ids, kept, strict=True) if not k or isinstance(k, Exception)}, True
    return {rid for rid, was in zip(ids, there, strict=True) if not was}, False


async def _apexpire(r: aioredis.Redis, names: list[str], ms: int, *, raise_on_error: bool = True) -> list:
    """PEXPIRE each of `names` to `ms`: one pipelined round trip; the replies."""
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.pexpire(name, ms)
    return await pipe.execute(raise_on_error=raise_on_error)


def leases_alive(r: redis.Redis, request_ids: list[str], shard: int = 0) -> set[str]:
    """Which of `request_ids` (all in `shard`) still have their lease: one MGET."""
    if not request_ids:
        return set()
    values = r.mget([keys.lease(rid, shard) for rid in request_ids])
    return {rid for rid, v in zip(request_ids, values, strict=True) if v is not None}
