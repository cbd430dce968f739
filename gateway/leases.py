"""The leases one gateway holds on the requests it relays (kvfleet:{s}:lease:{request}, shared.streams.leases).

A lease is set by the enqueue itself (in the same Lua step, shared.streams.aenqueue_routed) and refreshed
while the relay runs: one background task per gateway refreshes every lease it holds in one round trip (a
script per shard, safe to send again: shared.streams.ahold_leases) every third of the TTL (never one timer
per request). The relay releases it when it ends; a released lease is left to expire. When the gateway dies
the refreshes stop, the leases lapse, and the workers abort the requests nobody reads
(gpu_worker.serve.intake). A lease the relay stopped touching for request_timeout_s (a relay that never
started) is dropped, so none is held forever.

A refresh that finds a held lease gone (its SET puts it back) looks for the request's stream entry in the
same turn. Still there (queued, or pending on its worker: not acked), the lease only lapsed while Redis or
this gateway stalled, and the request goes on: the worker confirms a lapse on two reads 2 s apart, and the
lease is back before the second (a Redis stall past the TTL would otherwise have every request in flight
placed again at once). Gone, the request is lost (`is_lost`): Redis lost its data (a restart without
persistence or the last second of an AOF, a FLUSHALL), or the worker let the request go (this gateway
stalled past the TTL and the worker's confirmation, and the worker aborted it), or the entry moved (handed
back, forwarded): the relay places it again. (A worker's abort that reaches the relay before a refresh has
run tells it the same: gateway.relay.)

The same round trip shortens the expiry of the output streams the relays are done with (`read_out`: the
streams a relay restored its chunks into when it placed a request again, gateway.relay): no PEXPIRE of its
own per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shared import keys, streams
from shared.outage_log import OutageLog

log = logging.getLogger("kvfleet.gateway")

RETRY_S = 0.5  # after a failed refresh (Redis away), try again this soon: a lease that lapsed comes back fast


class Leases:
    def __init__(self, ttl_s: float, max_idle_s: float, read_out_ttl_s: float = 120.0):
        self.ttl_s, self.max_idle_s, self.read_out_ttl_s = ttl_s, max_idle_s, read_out_ttl_s
        self.held: dict[str, float] = {}  # request id -> loop time after which it is dropped unless touched
        # request id -> its request-stream entry (stream, id); the stream's name says the shard its lease is in
        self.entries: dict[str, tuple[str, str]] = {}
        self.lost: set[str] = set()  # held requests whose lease a refresh found gone
        self.read_out: list[str] = []  # output streams read to their end, to expire in read_out_ttl_s
        self._task: asyncio.Task | None = None
        self._r: Any = None
        self._outage = OutageLog(log, "the lease refresh")

    def hold(self, r: Any, request_id: str, entry: tuple[str, str]) -> None:
        """Keep the request's lease (set by its enqueue of the request-stream `entry`, in that stream's shard)
        refreshed until released."""
        self.entries[request_id] = entry
        self.touch(request_id)
        self._r = r
        self._run()

    def expire_later(self, stream: str) -> None:
        """A relay read this output stream to its end: it expires read_out_ttl_s after the next refresh."""
        self.read_out.append(stream)
        self._run()

    def _run(self) -> None:
        if (self._task is None or self._task.done()) and self._r is not None:
            self._task = asyncio.get_running_loop().create_task(self._refresh(self._r))

    def touch(self, request_id: str) -> None:
        """The relay is still at work on it (called as chunks arrive: one dict write, no Redis)."""
        self.held[request_id] = asyncio.get_running_loop().time() + self.max_idle_s

    def release(self, request_id: str) -> None:
        """Its relay ended: stop refreshing (the key expires within the TTL)."""
        self.held.pop(request_id, None)
        self.entries.pop(request_id, None)
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
        while self.held or self.read_out:
            await asyncio.sleep(wait)
            now = loop.time()
            for rid in [rid for rid, until in self.held.items() if until < now]:
                log.warning("lease on %s dropped: its relay did not touch it for %.0fs", rid, self.max_idle_s)
                del self.held[rid]
                self.entries.pop(rid, None)
            read_out, self.read_out = self.read_out, []
            try:
                shards = {rid: keys.stream_shard(self.entries[rid][0]) for rid in self.held}
                gone, full = await streams.ahold_leases(r, shards, self.ttl_s, expire=read_out,
                                                        expire_s=self.read_out_ttl_s)
                gone &= self.held.keys()
                if gone:
                    going = await streams.aentries_exist(r, {rid: self.entries[rid] for rid in gone})
                    if going and full:  # not set; their workers abort nothing while Redis refuses their writes too
                        log.warning("%d lease(s) had lapsed, their requests still queued or running, and Redis is "
                                    "full: it refused to set them again (retried at the next refresh), %s",
                                    len(going), ", ".join(sorted(going)[:5]))
                    elif going:
                        log.warning("%d lease(s) had lapsed (Redis or this gateway stalled past the TTL), their "
                                    "requests still queued or running: set again, %s", len(going),
                                    ", ".join(sorted(going)[:5]))
                    gone -= going
                if gone:
                    log.warning("%d lease(s) were gone from Redis with their requests (lost with its data, or let "
                                "go by their workers): %s", len(gone), ", ".join(sorted(gone)[:5]))
                self.lost |= gone
                wait = self.ttl_s / 3
                self._outage.ok()
            except streams.RedisError as e:
                self.read_out[:0] = read_out
                wait = min(RETRY_S, self.ttl_s / 3)
                self._outage.failed(e, f"retrying every {wait:.1f}s for the {len(self.held)} lease(s) held")
