"""What one gateway process holds for all its requests (and a services.fleet_calls.FleetCaller for its own):
the settings, the asyncio Redis clients (redis-py's, and a multiplexed connection for the per-request enqueue
where the server allows one), the tokenizers, the metrics, the lock that places one request at
a time, the leases on the requests it relays and the inbox their output comes back through (None for a
FleetCaller: services' requests run to the end, and their output has streams of its own) and its fleet view
(gateway.fleet_view)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gateway.fleet_view import FleetViews
from gateway.inbox import Inbox
from gateway.leases import Leases
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import Tokenizers
from shared.settings import Settings


@dataclass
class GatewayState:
    settings: Settings
    redis: Any  # redis.asyncio.Redis, made by shared.streams.connect_async
    tokenizers: Tokenizers
    per_request: Any = None  # a shared.streams.Multiplexed for the enqueue (None: through `redis`)
    background: set[asyncio.Task] = field(default_factory=set)
    admission: asyncio.Lock = field(default_factory=asyncio.Lock)  # one placement at a time per gateway
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    leases: Leases | None = None
    inbox: Inbox | None = None
    views: FleetViews | None = None  # the gateway's shared fleet view (None: read Redis for every request)
    # worker id -> loop time until which routing leaves it out: its request stream holds another Redis type (another
    # program's write), so an enqueue there fails; tried again after streams.RECHECK_S, not at every request
    unroutable: dict[str, float] = field(default_factory=dict)

    def let_go(self, request_id: str) -> None:
        """Its relay ended (or never started): stop refreshing its lease and collecting its output."""
        if self.leases is not None:
            self.leases.release(request_id)
        if self.inbox is not None:
            self.inbox.close_box(request_id)

    def spawn(self, coro: Any) -> None:
        """Run `coro` to completion even if the caller's scope is being cancelled (a client disconnect)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
