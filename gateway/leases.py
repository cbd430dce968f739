"""The leases one gateway holds on the requests it relays (kvfleet:lease:{request}, shared.streams.leases).

A lease is set when its request is placed, before the enqueue, and refreshed while the relay runs: one
background task per gateway refreshes every lease it holds in one pipelined round trip every third of the
TTL (never one timer per request). The relay releases it when it ends; a released lease is left to expire.
When the gateway dies the refreshes stop, the leases lapse, and the workers abort the requests nobody reads
(gpu_worker.serve.intake). A lease the relay stopped touching for request_timeout_s (a relay that never
started) is dropped, so none is held forever.

A refresh that finds a held lease gone tells the relay its request is lost (`is_lost`): Redis lost its data
(a restart without persistence or the last second of an AOF, a FLUSHALL), or this gateway stalled past the
TTL and the worker aborted the request. Either way nobody will answer it: the relay places it again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shared import streams

log = logging.getLogger("kvfleet.gateway")

RETRY_S = 0.5  # after a failed refresh (Redis away), try again this soon: a lease that lapsed comes back fast


class Leases:
    def __init__(self, ttl_s: float, max_idle_s: float):
        self.ttl_s, self.max_idle_s = ttl_s, max_idle_s
        self.held: dict[str, float] = {}  # request id -> loop time after which it is dropped unless touched
        self.lost: set[str] = set()  # held requests whose lease a refresh found gone
        self._task: asyncio.Task | None = None

    async def take(self, r: Any, request_id: str) -> None:
        """Set the request's lease now (before it is enqueued) and keep it refreshed until released."""
        await streams.ahold_leases(r, [request_id], self.ttl_s)
        self.touch(request_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._refresh(r))

    def touch(self, request_id: str) -> None:
        """The relay is still at work on it (called as chunks arrive: one dict write, no Redis)."""
        self.held[request_id] = asyncio.get_running_loop().time() + self.max_idle_s

    def release(self, request_id: str) -> None:
        """Its relay ended: stop refreshing (the key expires within the TTL)."""
        self.held.pop(request_id, None)
        self.lost.discard(request_id)

    def is_lost(self, request_id: str) -> bool:
        """Did a refresh find the request's lease gone? (Checked by its relay between reads: no Redis call.)"""
        return request_id in self.lost

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _refresh(self, r: Any) -> None:
        loop = asyncio.get_running_loop()
        wait = self.ttl_s / 3
        while self.held:
            await asyncio.sleep(wait)
            now = loop.time()
            for rid in [rid for rid, until in self.held.items() if until < now]:
                log.warning("lease on %s dropped: its relay did not touch it for %.0fs", rid, self.max_idle_s)
                del self.held[rid]
            try:
                gone = await streams.ahold_leases(r, list(self.held), self.ttl_s) & self.held.keys()
                if gone:
                    log.warning("%d lease(s) were gone from Redis (lost with its data, or lapsed): %s",
                                len(gone), ", ".join(sorted(gone)[:5]))
                self.lost |= gone
                wait = self.ttl_s / 3
            except streams.RedisError as e:
                wait = min(RETRY_S, self.ttl_s / 3)
                log.warning("could not refresh %d lease(s): %s; retrying in %.1fs", len(self.held), e, wait)
