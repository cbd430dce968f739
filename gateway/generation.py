"""One generation through the fleet, from the gateway's side: find the workers that serve the model (its
prompts are then prepared by gateway.prompts), build each request and check it against the caches, place it
(route, reserve, enqueue), then relay its output chunks, cancelling it when the client goes away or nothing
arrives in time. services.fleet_calls builds and places through the same functions (build_request, place)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway import fleet
from gateway.errors import APIError, bad_request
from gateway.instrumentation import RelayObserver, annotate_request
from gateway.metrics import GatewayMetrics
from gateway.prompts import Prepared, Prompt, part_ids
from gateway.tokenizer import same_model
from shared import streams
from shared.blocks import blocks_for, request_blocks
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.settings import Settings

log = logging.getLogger("kvfleet.gateway")


@dataclass
class GatewayState:
    settings: Settings
    redis: Any  # redis.asyncio.Redis
    tokenizers: Any  # gateway.tokenizer.Tokenizers
    background: set[asyncio.Task] = field(default_factory=set)
    admission: asyncio.Lock = field(default_factory=asyncio.Lock)  # one placement at a time per gateway
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)

    def spawn(self, coro: Any) -> None:
        """Run `coro` to completion even if the caller's scope is being cancelled (a client disconnect)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


@dataclass
class Target:
    model: str  # the name answered back to the client
    workers: list[WorkerStatus]
    view: fleet.FleetView
    tokenizer: Any
    max_model_len: int
    block_size: int
    max_total_blocks: int


async def target_for(state: GatewayState, model: str) -> Target:
    """The live workers serving `model` and its tokenizer; 503 when none lives, 404 for an unknown model."""
    view = await fleet.read_fleet(state.redis)
    settings = state.settings
    if not view.live and not settings.queue_when_no_workers:
        raise APIError(503, "no worker is alive to serve requests; start one with `kvfleet worker`",
                       code="no_workers", headers={"Retry-After": str(settings.retry_after_s)})
    workers = view.serving(lambda w: same_model(model, w.model, w.model_path))
    if not workers and view.live:
        served = sorted({w.model for w in view.live})
        raise APIError(404, f"the model {model!r} does not exist; this fleet serves: {', '.join(served)}",
                       param="model", code="model_not_found")
    if not workers:  # scale to zero: queue for the gateway's own model
        if not same_model(model, settings.model, ""):
            raise APIError(404, f"the model {model!r} does not exist; this gateway serves {settings.model!r}",
                           param="model", code="model_not_found")
        tok = await state.tokenizers.get(settings.model)
        return Target(model, [], view, tok, max_model_len=0, block_size=16, max_total_blocks=1 << 30)
    tok = await state.tokenizers.get(workers[0].model_path or settings.model)
    return Target(model=model, workers=workers, view=view, tokenizer=tok,
                  max_model_len=min(w.max_model_len for w in workers), block_size=workers[0].block_size,
                  max_total_blocks=max(w.total_blocks for w in workers))


@dataclass
class Planned:
    """A request built and checked, not yet placed."""

    request: GenerationRequest
    target: Target
    routing_blocks: int  # what routing counts for it: prompt plus (capped) output, times n

    def serves(self, w: WorkerStatus) -> bool:
        """The workers it may go to: those that serve its model (as target_for found them)."""
        return any(w.worker_id == t.worker_id for t in self.target.workers)


@dataclass
class Submitted:
    request_id: str
    target: Target
    request: GenerationRequest
    placement: fleet.Placement

    @property
    def num_choices(self) -> int:
        return self.request.params().n

    def prompt_of(self, _choice: int) -> str | None:
        return self.request.prompt


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


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_request(settings: Settings, target: Target, prompt: Prompt, *, priority: int,
                  request_id: str) -> Planned:
    """The request with its KV-block count; 400 when it is empty or can never fit the largest cache."""
    ids, params = prompt.token_ids, prompt.params
    if not ids:
        raise bad_request("the prompt is empty: at least one token is needed", "prompt")
    bs = target.block_size
    need_now = request_blocks(len(ids), 1, params.n, bs)
    if target.workers and need_now > target.max_total_blocks:
        raise bad_request(f"the prompt needs {need_now} KV blocks ({len(ids)} tokens, n={params.n}, block "
                          f"size {bs}) but the largest worker's cache has {target.max_total_blocks}", "prompt",
                          "prompt_too_large")
    out_tokens = min(params.max_tokens or 1, settings.route_max_output_tokens)
    routing_blocks = min(request_blocks(len(ids), out_tokens, params.n, bs), target.max_total_blocks)
    request = GenerationRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params.to_dict(),
                                model=target.model, priority=priority, prompt=prompt.text)
    return Planned(request, target, routing_blocks)


async def place(state: GatewayState, planned: Planned) -> Submitted:
    """Route, reserve and enqueue a built request (429 when the fleet is full). The caller holds
    state.admission: one placement at a time per gateway (or per FleetCaller)."""
    s = state.settings
    placement = await fleet.place(state.redis, s, planned.request, planned.serves, policy=s.routing,
                                  routing_blocks=planned.routing_blocks)
    state.metrics.routed(placement.policy, placement.worker_id)
    sub = Submitted(planned.request.request_id, planned.target, planned.request, placement)
    annotate_request(sub)
    return sub


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
            state.spawn(streams.acancel(state.redis, sub.request_id))
        raise
    return Batch(rid, subs)


def chunk_error(chunk: OutputChunk) -> APIError:
    err = chunk.error
    assert err is not None
    if err.kind == "invalid_request":
        return bad_request(err.message, code="rejected_by_worker")
    return APIError(500, err.message, type="server_error", code=err.kind)


async def relay(state: GatewayState, sub: Submitted, disconnected: Any = None) -> AsyncIterator[OutputChunk]:
    """The request's chunks, each once, in order. Cancels the request on the worker if the consumer stops
    early (client gone), `disconnected()` turns true (checked at most every 0.25 s, between chunks), or no
    chunk arrives within request_timeout_s (-> 504)."""
    settings = state.settings
    finished, next_check = False, 0.0
    chunks = streams.aiter_output(state.redis, sub.request_id, timeout_s=settings.request_timeout_s,
                                  expire_after_s=settings.output_ttl_after_read_s)
    loop = asyncio.get_running_loop()
    observer = RelayObserver(state.metrics, sub)
    try:
        async for chunk in chunks:
            observer.chunk(chunk)
            finished = chunk.final
            yield chunk
            if disconnected is not None and not finished and loop.time() >= next_check:
                next_check = loop.time() + 0.25
                if await disconnected():
                    return
    except streams.OutputTimeout:
        raise APIError(504, f"no output within {settings.request_timeout_s:g}s; the request was cancelled",
                       code="timeout") from None
    finally:
        if not finished:
            log.info("cancelling %s (client gone or timed out)", sub.request_id)
            state.spawn(streams.acancel(state.redis, sub.request_id))


async def watch_disconnect(http_request: Any, task: asyncio.Task, interval_s: float = 0.25) -> None:
    """For non-streaming calls: cancel `task` (and so the fleet request) when the client disconnects."""
    while not task.done():
        if await http_request.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(interval_s)


def routing_header(batch: Batch) -> dict[str, str]:
    """Where it went: the response id, and per prompt (comma-separated in a batch) the worker ("any": the
    shared queue) and the prompt's KV blocks."""
    subs = batch.subs
    return {"X-Request-Id": batch.request_id,
            "X-Kvfleet-Worker": ",".join(s.placement.worker_id or "any" for s in subs),
            "X-Kvfleet-Prompt-Blocks": ",".join(str(blocks_for(len(s.request.prompt_token_ids), s.target.block_size))
                                                for s in subs)}
