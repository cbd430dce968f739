"""The fleet as one gateway sees it: read from Redis at most every `max_age_s`, one read shared by every
request that asks meanwhile, instead of a read (each shard's SMEMBERS, then a GET and an HVALS per worker, and a
JSON parse per status) for each request twice; the shards themselves every SHARDS_EVERY_S. Workers publish their status at most 20 times a second, so a view this
young is as fresh as what Redis holds.

What this gateway reserves between two reads it adds to the view itself (`reserved`), so a burst it places
within one `max_age_s` spreads as if each placement read Redis. Other gateways' placements show at the next
read; the enqueue's Lua check (shared.streams.aenqueue_routed) refuses a worker that is full whatever the view
said, and placement then routes again without it.

It also remembers when it last pushed out the expiry of each worker's reservations hash (`expiry_due`), so an
enqueue does that once per third of the hash's TTL per gateway, not once per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from shared import streams
from shared.fleet_state import FleetView

SHARDS_EVERY_S = 1.0  # the shards workers live in change only when a worker first lives in a new one


class FleetViews:
    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self._view: FleetView | None = None
        self._read_at = 0.0
        self._reading: asyncio.Future | None = None
        self._shards: list[int] | None = None
        self._shards_at = 0.0
        self._expiry_pushed: dict[tuple[str, int], float] = {}  # (worker, shard) -> loop time of the last push
        self.live_at = float("-inf")  # loop time of the last read that found a live worker

    async def get(self, r: Any) -> FleetView:
        loop = asyncio.get_running_loop()
        if self._view is not None and loop.time() - self._read_at < self.max_age_s:
            return self._view
        if self._reading is None:
            self._reading = loop.create_task(self._read(r))
        return await asyncio.shield(self._reading)

    async def _read(self, r: Any) -> FleetView:
        try:
            now = asyncio.get_running_loop().time()
            if self._shards is None or now - self._shards_at >= SHARDS_EVERY_S:
                self._shards, self._shards_at = await streams.aread_shards(r), now
            view = await streams.aread_fleet(r, self._shards)
            self._view, self._read_at = view, asyncio.get_running_loop().time()
            if view.live:
                self.live_at = self._read_at
            return view
        finally:
            self._reading = None

    def expiry_due(self, worker_id: str, shard: int, ttl_s: float) -> bool:
        """Whether an enqueue on the worker should push its reservations' expiry out (to `ttl_s`): this gateway
        has not done so in the last third of it."""
        last = self._expiry_pushed.get((worker_id, shard))
        return last is None or asyncio.get_running_loop().time() - last >= ttl_s / 3

    def reserved(self, worker_id: str, blocks: int, *, shard: int = 0, expiry_pushed: bool = False) -> None:
        """This gateway just reserved `blocks` on `worker_id`: count them until the next read (and, with
        `expiry_pushed`, that enqueue pushed the reservations' expiry out)."""
        if expiry_pushed:
            self._expiry_pushed[(worker_id, shard)] = asyncio.get_running_loop().time()
        if self._view is not None:
            reservations = dict(self._view.reservations)
            reservations[worker_id] = reservations.get(worker_id, 0) + blocks
            self._view = dataclasses.replace(self._view, reservations=reservations)


async def read_view(views: FleetViews | None, r: Any) -> FleetView:
    """The fleet view through `views`, or straight from Redis when there is none (a services FleetCaller)."""
    return await (views.get(r) if views is not None else streams.aread_fleet(r))
