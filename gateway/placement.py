"""Placing one generation in the fleet, from the gateway's side: for the workers that serve the model
(gateway.targets; its prompts are then prepared by gateway.prompts), build each request and check it against
the caches, then place it: route it among the live workers, reserve its blocks on the chosen one and enqueue it
there (or on the shared stream when none can take it now; 429 when that is full too). The routing and enqueue spans are
made here; the worker continues the trace from the context the enqueue span puts into the stream entry.

services.fleet_calls builds and places through the same functions (build_request, place).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from gateway.errors import APIError, bad_request
from gateway.fleet_view import read_view
from gateway.prompts import Prepared, Prompt, part_ids
from gateway.router import prefix_overlap, route
from gateway.state import GatewayState
from gateway.targets import Target
from shared import keys, streams
from shared import telemetry as t
from shared.blocks import block_hashes, blocks_for, request_blocks
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.settings import Settings

OPERATIONS = {"chatcmpl": "chat", "cmpl": "text_completion"}  # request id prefix -> gen_ai.operation.name
MAX_ROUTE_TRIES = 3


@dataclass
class Planned:
    """A request built and checked, not yet placed."""

    request: GenerationRequest
    target: Target
    routing_blocks: int  # what routing counts for it: prompt plus (capped) output, times n

    def serves(self, w: WorkerStatus) -> bool:
        """The workers it may go to: those that serve its model (as target_for found them)."""
        return any(w.worker_id == c.worker_id for c in self.target.workers)


@dataclass
class Placement:
    worker_id: str | None  # None: the shared stream
    entry_id: str
    policy: str
    shard: int = 0  # where its stream entry, lease and output are (shared.keys)

    @property
    def stream(self) -> str:
        """The request stream it was enqueued on."""
        return keys.req_any(self.shard) if self.worker_id is None else keys.req_stream(self.worker_id, self.shard)


@dataclass
class Submitted:
    request_id: str
    target: Target
    request: GenerationRequest
    placement: Placement

    @property
    def num_choices(self) -> int:
        return self.request.sampling_params.get("n", 1)

    @property
    def n(self) -> int:
        """Choices per prompt (one prompt: all of them), as Batch.n."""
        return self.num_choices

    def prompt_of(self, _choice: int) -> str | None:
        return self.request.prompt

    def prompt_ids_of(self, _choice: int) -> list[int]:
        return self.request.prompt_token_ids


@dataclass
class Batch:
    """A completion's prompts, each its own fleet request, answered as one response: prompt i's choice j is
    choice i * n + j."""

    request_id: str  # the response's id (the only prompt's request id when there is one)
    subs: list[Submitted]

    @property
    def target(self) -> Target:
        return self.subs[0].target

    @property
    def n(self) -> int:
        return self.subs[0].num_choices

    @property
    def num_choices(self) -> int:
        return self.n * len(self.subs)

    def prompt_of(self, choice: int) -> str | None:
        return self.subs[choice // self.n].request.prompt

    def prompt_ids_of(self, choice: int) -> list[int]:
        return self.subs[choice // self.n].request.prompt_token_ids


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_request(settings: Settings, target: Target, prompt: Prompt, *, priority: int,
                  request_id: str) -> Planned:
    """The request with its KV-block count; 400 when it is empty or can never fit the largest cache."""
    ids, params = prompt.token_ids, prompt.params
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", "prompt")
    if target.outage is not None:
        raise target.outage
    bs = target.block_size
    need_now = request_blocks(len(ids), 1, params.n, bs)
    if target.workers and need_now > target.max_total_blocks:
        raise bad_request(f"the prompt needs {need_now} KV blocks ({len(ids)} tokens, n={params.n}, block "
                          f"size {bs}) but the largest worker's cache has {target.max_total_blocks}", "prompt",
                          "prompt_too_large")
    request = GenerationRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params.to_dict(),
                                model=target.model, priority=priority, prompt=prompt.text)
    return Planned(request, target, _routing_blocks(settings, target, request))


def _routing_blocks(settings: Settings, target: Target, request: GenerationRequest) -> int:
    """What routing counts for a request: prompt plus (capped) output, times n, at most the largest cache."""
    sp = request.sampling_params  # (checked when built: no SamplingParams to make again)
    out_tokens = min(sp.get("max_tokens") or 1, settings.route_max_output_tokens)
    blocks = request_blocks(len(request.prompt_token_ids), out_tokens, sp.get("n", 1), target.block_size)
    return min(blocks, target.max_total_blocks)


def replan(settings: Settings, sub: Submitted, request_id: str) -> Planned:
    """A placed request, to be placed again under a new id (Redis lost it): one attempt later, so the worker
    that takes it resumes from the output stream (gateway.relay restores the chunks already relayed there)."""
    request = sub.request.model_copy(update={"request_id": request_id, "attempt": sub.request.attempt + 1,
                                             "kv_blocks": 0, "lease": False})
    return Planned(request, sub.target, _routing_blocks(settings, sub.target, request))


async def place(state: GatewayState, planned: Planned, restore: list[OutputChunk] | None = None) -> Submitted:
    """Route, reserve and enqueue a built request (429 when the fleet is full). The caller holds
    state.admission: one placement at a time per gateway (or per FleetCaller). A gateway (state.leases set)
    has the enqueue set the request's lease: its relay keeps it, and the worker aborts the request once it
    lapses; and it opens the request's mailbox in its inbox, which the workers write its output to. `restore`:
    chunks a relay already gave its client (a request placed again), written into its output stream in the
    shard it goes to before it is enqueued there, so that its worker resumes after them."""
    leases, inbox, rid = state.leases, state.inbox, planned.request.request_id
    planned.request.lease = leases is not None
    if inbox is not None:  # its output comes back batched with the gateway's other requests
        planned.request.reply_to = inbox.gateway_id
        inbox.open(rid)
    try:
        placement = await _route_and_enqueue(state, planned, None if leases is None else leases.ttl_s, restore)
    except BaseException:
        state.let_go(rid)
        raise
    if leases is not None:
        leases.hold(state.redis, rid, (placement.stream, placement.entry_id))
    state.metrics.routed(placement.policy, placement.worker_id)
    sub = Submitted(planned.request.request_id, planned.target, planned.request, placement)
    annotate_request(sub)
    return sub


async def _route_and_enqueue(state: GatewayState, planned: Planned, lease_ttl_s: float | None,
                             restore: list[OutputChunk] | None) -> Placement:
    """Among the live workers that serve the request, route, reserve and enqueue, routing again (up to
    MAX_ROUTE_TRIES, without the workers that refused) when the worker filled up meanwhile or has
    `worker_queue_bound` requests waiting (every policy); when none can take it, the shared stream; 429 (with
    Retry-After) when that is over its bound. The Lua checks in shared.streams keep gateway replicas from
    over-committing a worker. The request goes into the chosen worker's shard (the shared stream: a shard
    some serving worker lives in)."""
    r, settings = state.redis, state.settings
    request, policy, routing_blocks = planned.request, settings.routing, planned.routing_blocks
    checks_room = policy in ("free_blocks", "prefix")
    if state.unroutable:  # workers whose stream holds another type, left out for a while (below)
        now = asyncio.get_running_loop().time()
        state.unroutable = {w: until for w, until in state.unroutable.items() if until > now}
    refused: set[str] = set(state.unroutable)
    ready: set[int] = set()  # shards where its inbox is read and its restored output written

    async def into(shard: int) -> None:
        if shard not in ready:
            ready.add(shard)
            if state.inbox is not None:
                await state.inbox.read_shard(shard)
            if restore:
                await streams.arestore_output(r, request.request_id, restore, settings.output_ttl_s, shard)

    shards = [0]
    for _ in range(MAX_ROUTE_TRIES):
        with t.span("kvfleet.route", attributes={t.KVFLEET_ROUTING_POLICY: policy,
                                                 t.KVFLEET_KV_BLOCKS: routing_blocks}) as span:
            view = await read_view(state.views, r)
            serving = view.serving(planned.serves)
            shards = sorted({w.shard for w in serving}) or [0]
            candidates = [w for w in serving if w.worker_id not in refused]
            hashes: list[str] = []
            overlap: dict[str, int] = {}
            turn = 0
            if policy == "prefix" and candidates:
                hashes = block_hashes(request.prompt_token_ids, candidates[0].block_size, request.model)
                overlap = prefix_overlap(await streams.aprefix_owners(r, hashes))
            elif policy == "round_robin":
                turn = await streams.anext_turn(r)
            worker = route(routing_blocks, candidates, policy, view.reservations,
                           reserve_blocks=settings.reserve_blocks, turn=turn, prompt_blocks=len(hashes),
                           prefix_overlap=overlap, prefill_weight=settings.prefix_weight,
                           affinity_slack=settings.prefix_affinity_slack)
            note_route(span, worker, candidates, view.reservations)
        if worker is None:
            break
        request.kv_blocks = routing_blocks
        shard = next(w.shard for w in candidates if w.worker_id == worker)
        await into(shard)
        push = state.views is None or state.views.expiry_due(worker, shard, settings.reservation_ttl_s)
        with enqueue_span(request, keys.req_stream(worker, shard)):
            try:
                entry_id = await streams.aenqueue_routed(
                    state.per_request or r, request, worker, shard,
                    min_headroom=settings.reserve_blocks if checks_room else None,
                    queue_bound=settings.worker_queue_bound, reservation_ttl_s=settings.reservation_ttl_s,
                    lease_ttl_s=lease_ttl_s, push_expiry=push)
            except streams.KeyOfAnotherType as e:  # its stream (say) holds another type: the others take it
                streams.report([e], "the gateway's routing")
                state.unroutable[worker] = asyncio.get_running_loop().time() + streams.RECHECK_S
                entry_id = None
        if entry_id is not None:
            if state.views is not None:
                state.views.reserved(worker, routing_blocks, shard=shard, expiry_pushed=push)
            if hashes:
                await streams.aremember_prefix(r, hashes, worker)
            return Placement(worker, entry_id, policy, shard)
        refused.add(worker)
    request.kv_blocks = 0
    shard = shards[zlib.crc32(request.request_id.encode()) % len(shards)]
    await into(shard)
    with enqueue_span(request, keys.req_any(shard)) as span:
        entry_id = await streams.aenqueue_shared(state.per_request or r, request, shard, bound=settings.queue_bound,
                                                 lease_ttl_s=lease_ttl_s)
        if entry_id is None:
            t.set_error(span, "shared queue full")
    if entry_id is None:
        raise APIError(
            429, f"the fleet is full: no worker can take this request now (it needs {routing_blocks} free KV "
                 f"blocks and a worker with fewer than {settings.worker_queue_bound} requests waiting) and "
                 f"{settings.queue_bound} requests already wait in the shared queue (KVFLEET_QUEUE_BOUND); retry "
                 "later",
            code="fleet_overloaded", headers={"Retry-After": str(settings.retry_after_s)})
    return Placement(None, entry_id, policy, shard)


async def submit(state: GatewayState, target: Target, prepared: Prepared, *, id_prefix: str) -> Batch:
    """Every prompt of `prepared` into the fleet, each as its own request. All are built and checked before
    the first is placed; when one cannot be placed (429), those already placed are cancelled."""
    rid = new_request_id(id_prefix)
    planned = [build_request(state.settings, target, p, priority=prepared.priority, request_id=part)
               for p, part in zip(prepared.prompts, part_ids(rid, len(prepared.prompts)), strict=True)]
    subs: list[Submitted] = []
    try:
        for p in planned:
            async with state.admission:
                subs.append(await place(state, p))
    except BaseException:
        for sub in subs:
            state.let_go(sub.request_id)
            state.spawn(streams.acancel(state.redis, sub.request_id))
        raise
    return Batch(rid, subs)


def routing_header(batch: Batch) -> dict[str, str]:
    """Where it went: the response id, and per prompt (comma-separated in a batch) the worker ("any": the
    shared queue) and the prompt's KV blocks."""
    subs = batch.subs
    return {"X-Request-Id": batch.request_id,
            "X-Kvfleet-Worker": ",".join(s.placement.worker_id or "any" for s in subs),
            "X-Kvfleet-Prompt-Blocks": ",".join(str(blocks_for(len(s.request.prompt_token_ids), s.target.block_size))
                                                for s in subs)}


# ---- spans ----------------------------------------------------------------------------------------

def note_route(span: Any, worker_id: str | None, candidates: list[WorkerStatus], reservations: dict[str, int]) -> None:
    """What the router chose and saw, on its `kvfleet.route` span."""
    if not span.is_recording():
        return
    chosen = next((w for w in candidates if w.worker_id == worker_id), None)
    span.set_attributes({t.KVFLEET_WORKER_ID: worker_id or "none", "kvfleet.routing.candidates": len(candidates)})
    if chosen is not None:
        span.set_attributes({t.KVFLEET_ROUTING_FREE_BLOCKS: chosen.free_blocks,
                             "kvfleet.routing.available_blocks":
                                 chosen.available_blocks() - reservations.get(chosen.worker_id, 0)})


@contextlib.contextmanager
def enqueue_span(request: GenerationRequest, stream: str) -> Iterator[Any]:
    """A PRODUCER span around the XADD, whose context goes into the request (so into the stream entry):
    the worker that takes the entry, or a later one after a crash, continues the trace from it."""
    with t.span("kvfleet.enqueue", kind=SpanKind.PRODUCER,
                attributes={t.MESSAGING_SYSTEM: "redis", t.MESSAGING_DESTINATION: stream,
                            t.KVFLEET_REQUEST_ID: request.request_id}) as span:
        request.trace_context = t.inject()
        yield span


def annotate_request(sub: Submitted) -> None:
    """GenAI attributes of a placed request on the current (server) span."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    req, sp = sub.request, sub.request.sampling_params
    span.set_attributes({k: v for k, v in {
        t.GEN_AI_SYSTEM: t.SYSTEM, t.GEN_AI_OPERATION_NAME: OPERATIONS.get(req.request_id.split("-")[0]),
        t.GEN_AI_REQUEST_MODEL: req.model, t.GEN_AI_REQUEST_MAX_TOKENS: sp.get("max_tokens"),
        t.GEN_AI_REQUEST_TEMPERATURE: sp.get("temperature"), t.GEN_AI_REQUEST_TOP_P: sp.get("top_p"),
        t.GEN_AI_REQUEST_CHOICE_COUNT: sp.get("n"), t.GEN_AI_USAGE_INPUT_TOKENS: len(req.prompt_token_ids),
        t.GEN_AI_RESPONSE_ID: req.request_id, t.KVFLEET_REQUEST_ID: req.request_id,
        t.KVFLEET_WORKER_ID: sub.placement.worker_id or "any",
        t.KVFLEET_ROUTING_POLICY: sub.placement.policy}.items() if v is not None})
