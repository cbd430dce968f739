"""The fleet as the gateway sees it in Redis: live workers (status present), their reservations, the shared
queue; and placing one request: route it, reserve its blocks on the chosen worker, enqueue it.

Everything here is read from Redis on each request, so gateway replicas agree without talking to each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from gateway import prefix_index
from gateway.errors import APIError
from gateway.instrumentation import enqueue_span, note_route
from gateway.router import route
from shared import keys, streams, telemetry
from shared.messages import GenerationRequest, WorkerStatus
from shared.settings import Settings


@dataclass
class FleetView:
    live: list[WorkerStatus] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    reservations: dict[str, int] = field(default_factory=dict)  # worker -> reserved blocks

    def serving(self, model_matches: Any) -> list[WorkerStatus]:
        return [w for w in self.live if model_matches(w)]


async def read_fleet(r: Any) -> FleetView:
    members = sorted(await r.smembers(keys.WORKERS))
    if not members:
        return FleetView()
    pipe = r.pipeline(transaction=False)
    for w in members:
        pipe.get(keys.status(w))
        pipe.hvals(keys.reserved(w))
    replies = await pipe.execute()
    view = FleetView()
    for w, raw, reserved in zip(members, replies[0::2], replies[1::2], strict=True):
        if raw is None:
            view.dead.append(w)
            continue
        view.live.append(WorkerStatus.model_validate_json(raw))
        view.reservations[w] = sum(int(v) for v in reserved)
    return view


async def shared_queue_depth(r: Any) -> int:
    """Requests in kvfleet:req:any that no worker has taken yet (taken ones are pending until acked)."""
    pipe = r.pipeline(transaction=False)
    pipe.xlen(keys.REQ_ANY)
    pipe.xinfo_groups(keys.REQ_ANY)
    try:
        length, groups = await pipe.execute()
    except redis.ResponseError:  # no stream yet (no worker ever started): nothing queued
        return 0
    pending = sum(g.get("pending", 0) for g in groups if g.get("name") == keys.GROUP)
    return max(0, length - pending)


@dataclass
class Placement:
    worker_id: str | None  # None: the shared stream
    entry_id: str
    policy: str


MAX_ROUTE_TRIES = 3


async def place(r: Any, settings: Settings, request: GenerationRequest, serves: Any, *, policy: str,
                routing_blocks: int) -> Placement:
    """Route, reserve and enqueue `request` among the live workers for which `serves(status)` holds; when
    none can take it, the shared stream; 429 (with Retry-After) when that is over its bound. The caller
    serializes calls within one gateway; the Lua checks in shared.streams keep replicas from over-committing."""
    checks_room = policy in ("free_blocks", "prefix")
    for _ in range(MAX_ROUTE_TRIES):
        with telemetry.span("kvfleet.route", attributes={telemetry.KVFLEET_ROUTING_POLICY: policy,
                                                         telemetry.KVFLEET_KV_BLOCKS: routing_blocks}) as span:
            view = await read_fleet(r)
            candidates = view.serving(serves)
            hashes: list[str] = []
            overlap: dict[str, int] = {}
            turn = 0
            if policy == "prefix" and candidates:
                hashes = prefix_index.block_hashes(request.prompt_token_ids, candidates[0].block_size, request.model)
                overlap = await prefix_index.overlap(r, hashes)
            elif policy == "round_robin":
                turn = await r.incr(keys.ROUND_ROBIN)
            worker = route(routing_blocks, candidates, policy, view.reservations,
                           reserve_blocks=settings.reserve_blocks, turn=turn, prompt_blocks=len(hashes),
                           prefix_overlap=overlap)
            note_route(span, worker, candidates, view.reservations)
        if worker is None:
            break
        request.kv_blocks = routing_blocks
        with enqueue_span(request, keys.req_stream(worker)):
            entry_id = await streams.aenqueue_routed(
                r, request, worker, min_headroom=settings.reserve_blocks if checks_room else None,
                reservation_ttl_s=settings.reservation_ttl_s)
        if entry_id is not None:
            if hashes:
                pipe = r.pipeline(transaction=False)
                prefix_index.remember_commands(pipe, hashes, worker)
                await pipe.execute()
            return Placement(worker, entry_id, policy)
    request.kv_blocks = 0
    with enqueue_span(request, keys.REQ_ANY) as span:
        entry_id = await streams.aenqueue_shared(r, request, bound=settings.queue_bound)
        if entry_id is None:
            telemetry.set_error(span, "shared queue full")
    if entry_id is None:
        raise APIError(
            429, f"the fleet is full: no worker has {routing_blocks} free KV blocks for this request and "
                 f"{settings.queue_bound} requests already wait in the shared queue; retry later",
            code="fleet_overloaded", headers={"Retry-After": str(settings.retry_after_s)})
    return Placement(None, entry_id, policy)


async def snapshot(r: Any) -> dict[str, Any]:
    """The fleet at a glance (GET /v1/fleet, `kvfleet status`): workers, streams, pending, dead letters."""
    view = await read_fleet(r)
    now = time.time()
    streams_info: dict[str, dict[str, int]] = {}
    for name in [keys.REQ_ANY] + [keys.req_stream(w) for w in [s.worker_id for s in view.live] + view.dead]:
        pipe = r.pipeline(transaction=False)
        pipe.xlen(name)
        pipe.xinfo_groups(name)
        try:
            length, groups = await pipe.execute()
        except redis.ResponseError:  # no such stream
            length, groups = 0, []
        pending = sum(g.get("pending", 0) for g in groups)
        streams_info[name] = {"length": length, "pending": pending}
    return {
        "workers": [s.model_dump() | {"heartbeat_age_s": round(now - s.heartbeat, 3),
                                      "reserved_blocks": view.reservations.get(s.worker_id, 0)}
                    for s in view.live],
        "dead_workers": view.dead,
        "streams": streams_info,
        "dead_letters": await r.xlen(keys.DEAD),
    }
