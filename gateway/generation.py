"""One generation through the fleet, from the gateway's side: find the workers that serve the model, check
the request against the context window and the caches, place it (route, reserve, enqueue), then relay its
output chunks, cancelling it when the client goes away or nothing arrives in time."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway import fleet
from gateway.errors import APIError, bad_request, param_of
from gateway.instrumentation import RelayObserver, annotate_request
from gateway.metrics import GatewayMetrics
from gateway.router import blocks_for, request_blocks
from gateway.tokenizer import same_model
from shared import streams
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.sampling_params import SamplingParams
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


def resolve_max_tokens(target: Target, prompt_len: int, max_tokens: int | None, param: str) -> int | None:
    """max_tokens as the workers will run it; 400 (with both numbers) when prompt + output exceed the window.
    With no worker alive (scale to zero) the window is unknown: the worker that takes it checks."""
    if not target.workers:
        return max_tokens
    limit = target.max_model_len
    if max_tokens is None:
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt is "
                              f"{prompt_len} tokens, leaving no room for output.", param, "context_length_exceeded")
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion "
            f"(max_tokens)). Please reduce the length of the prompt or max_tokens.", param,
            "context_length_exceeded")
    return max_tokens


def make_params(build: Any) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise bad_request(str(e), param_of(str(e)), "invalid_value") from None


@dataclass
class Submitted:
    request_id: str
    target: Target
    request: GenerationRequest
    placement: fleet.Placement


async def submit(state: GatewayState, target: Target, prompt_ids: list[int], params: SamplingParams, *,
                 priority: int, prompt: str | None, id_prefix: str) -> Submitted:
    if not prompt_ids:
        raise bad_request("the prompt is empty: at least one token is needed", "prompt")
    bs = target.block_size
    need_now = request_blocks(len(prompt_ids), 1, params.n, bs)
    if target.workers and need_now > target.max_total_blocks:
        raise bad_request(f"the prompt needs {need_now} KV blocks ({len(prompt_ids)} tokens, n={params.n}, block "
                          f"size {bs}) but the largest worker's cache has {target.max_total_blocks}", "prompt",
                          "prompt_too_large")
    out_tokens = min(params.max_tokens or 1, state.settings.route_max_output_tokens)
    routing_blocks = min(request_blocks(len(prompt_ids), out_tokens, params.n, bs), target.max_total_blocks)
    request = GenerationRequest(request_id=f"{id_prefix}-{uuid.uuid4().hex}", prompt_token_ids=prompt_ids,
                                sampling_params=params.to_dict(), model=target.model, priority=priority,
                                prompt=prompt)
    ids = {w.worker_id for w in target.workers}
    async with state.admission:
        placement = await fleet.place(state.redis, state.settings, request, lambda w: w.worker_id in ids,
                                      policy=state.settings.routing, routing_blocks=routing_blocks)
    state.metrics.routed(placement.policy, placement.worker_id)
    sub = Submitted(request.request_id, target, request, placement)
    annotate_request(sub)
    return sub


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


def routing_header(sub: Submitted) -> dict[str, str]:
    return {"X-Request-Id": sub.request_id, "X-Kvfleet-Worker": sub.placement.worker_id or "any",
            "X-Kvfleet-Prompt-Blocks": str(blocks_for(len(sub.request.prompt_token_ids), sub.target.block_size))}
