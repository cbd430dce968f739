"""A gateway's lease on a request, seen gone, cancels the request: nobody reads its output any more (its gateway
died). The worker's cancel thread reads, every LEASE_CHECK_S in one MGET, the leases of the requests it holds
whose gateway holds one (GenerationRequest.lease). A lease must be seen gone on checks LEASE_CONFIRM_S apart, with
no failed read between (Redis back from an outage: the gateway sets its leases again within a second), and while
Redis takes the worker's writes (full or unable to persist, it refuses the gateways' SETs too, so a lapsed lease
proves nothing then; they set them again once Redis takes writes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shared import streams

log = logging.getLogger("kvfleet.worker")

LEASE_CHECK_S = 1.0  # read the leases of the requests held this often
LEASE_CONFIRM_S = 2.0  # a lease must be seen gone this long before its request is aborted


class LeaseWatch:
    def __init__(self, r: streams.Client, shard: int, leased: Callable[[], list[str]],
                 writes_refused: Callable[[], bool] | None = None):
        self.r, self.shard = r, shard
        self.leased = leased  # the request ids the worker holds that carry a lease
        self.writes_refused = writes_refused  # Redis refuses the worker's writes now (full, or cannot persist)
        self._next_check = 0.0
        self._gone: dict[str, float] = {}  # request id -> when its lease was first seen gone

    def lapsed(self) -> list[str]:
        """The requests to cancel: read their leases when a check is due (raises RedisError)."""
        if time.monotonic() < self._next_check:
            return []
        self._next_check = time.monotonic() + LEASE_CHECK_S
        return self.check(self.leased())

    def check(self, request_ids: list[str]) -> list[str]:
        """Of `request_ids`, those whose lease is gone and stayed gone for LEASE_CONFIRM_S (one MGET)."""
        if self.writes_refused is not None and self.writes_refused():
            self._gone.clear()
            return []
        try:
            alive = streams.leases_alive(self.r, request_ids, self.shard)
        except streams.RedisError:
            self._gone.clear()  # what was seen before the outage proves nothing after it
            raise
        now = time.monotonic()
        self._gone = {rid: self._gone.get(rid, now) for rid in request_ids if rid not in alive}
        lapsed = [rid for rid, since in self._gone.items() if now - since >= LEASE_CONFIRM_S]
        for rid in lapsed:
            log.warning("request %s: its lease lapsed (its gateway is gone): aborting it", rid)
            del self._gone[rid]
        return lapsed
