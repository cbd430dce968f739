"""Leases on requests: a gateway holds kvfleet:{s}:lease:{request} (a short TTL) while its client waits and
refreshes all of its leases in one round trip; a worker reads the leases of the requests it holds in one
round trip, and aborts those whose lease lapsed (their gateway died: nobody reads the output)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.streams.client import out_of_memory


async def ahold_leases(r: aioredis.Redis, request_ids: Mapping[str, int], ttl_s: float, *,
                       expire: Iterable[str] = (), expire_s: float = 0.0) -> tuple[set[str], bool]:
    """Set (or refresh) the lease of every request in `request_ids` (request id -> its shard) to expire in
    `ttl_s`: one round trip.
    SET, not PEXPIRE, so a lease that expired while Redis was away comes back. -> (the requests whose lease
    was not there (SET ... GET): Redis lost it (a restart without the data, a FLUSHALL), or it lapsed; whether
    Redis was full). A full Redis (maxmemory, noeviction) refuses the SETs: the leases there are then kept with
    PEXPIRE, and those not there stay gone.
    In the same round trip, the keys in `expire` (output streams read to their end) expire in `expire_s`."""
    ms = max(1, int(ttl_s * 1000))
    ids = list(request_ids)
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.set(keys.lease(rid, request_ids[rid]), 1, px=ms, get=True)
    for key in expire:
        pipe.pexpire(key, max(1, int(expire_s * 1000)))
    full = False
    try:
        previous = (await pipe.execute())[:len(ids)]
    except redis.ResponseError as e:
        if not out_of_memory(e):
            raise
        # Redis is full: it refuses the SETs but takes PEXPIRE, so the leases that are there are kept (else they
        # would lapse and the workers abort what their clients wait for); one gone cannot be set again
        pipe = r.pipeline(transaction=False)
        for rid in ids:
            pipe.pexpire(keys.lease(rid, request_ids[rid]), ms)
        previous = (await pipe.execute(raise_on_error=False))[:len(ids)]
        previous = [None if not kept or isinstance(kept, Exception) else kept for kept in previous]
        full = True
    return {rid for rid, old in zip(ids, previous, strict=True) if old is None}, full


def leases_alive(r: redis.Redis, request_ids: list[str], shard: int = 0) -> set[str]:
    """Which of `request_ids` (all in `shard`) still have their lease: one MGET."""
    if not request_ids:
        return set()
    values = r.mget([keys.lease(rid, shard) for rid in request_ids])
    return {rid for rid, v in zip(request_ids, values, strict=True) if v is not None}
