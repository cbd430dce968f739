"""Relaying one placed request's output to its client: its chunks, each once and in order, cancelling the
request on the worker when the client goes away or nothing arrives in time, and keeping its lease
(gateway.leases) while it runs; and `RelayObserver`, which marks the first token and the usage of the
generation on the request's server span."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace

from gateway.errors import APIError, bad_request
from gateway.fleet_view import read_view
from gateway.inbox import WorkerLost
from gateway.metrics import GatewayMetrics
from gateway.placement import Submitted, place, replan
from gateway.state import GatewayState
from shared import keys, streams
from shared import telemetry as t
from shared.messages import OutputChunk

log = logging.getLogger("kvfleet.gateway")


def chunk_error(chunk: OutputChunk) -> APIError:
    err = chunk.error
    assert err is not None
    if err.kind == "invalid_request":
        return bad_request(err.message, code="rejected_by_worker")
    return APIError(500, err.message, type="server_error", code=err.kind)


MAX_REPLACEMENTS = 2  # times one relay places a request again after Redis lost it


async def relay(state: GatewayState, sub: Submitted) -> AsyncIterator[OutputChunk]:
    """The request's chunks, each once, in order. Cancels the request on the worker if the consumer stops
    early (its client went away: gateway.sse.Disconnect cancels the answer's task, which closes this), or no
    chunk arrives within request_timeout_s (-> 504). Redis unreachable pauses the relay for up to
    redis_grace_s, then it goes on where it stopped; past the grace it ends with a 503 (an error event, then
    [DONE], when streaming). When Redis lost the request (restarted without its data or the last second of
    its AOF, flushed; or the worker let it go, its lease having lapsed while this gateway stalled: found by a
    lease refresh, or by the worker's abort, which it never asked for) the relay places it again under a new
    id, with the chunks already relayed restored, so a worker resumes after them: the client sees every
    token once (MAX_REPLACEMENTS times; then a 503). So it does when the worker running it died (the worker
    that took its entry over hands it back: gateway.inbox.WorkerLost), up to max_deliveries times in all."""
    settings = state.settings
    finished, relayed = False, []
    observer = RelayObserver(state.metrics, sub)
    leases = state.leases
    redis_lost = worker_lost = 0
    restored: list[str] = []  # the output streams it wrote relayed chunks into, placing it again
    try:
        while True:
            try:
                async for chunk in _chunks(state, sub, relayed[-1].seq if relayed else -1):
                    if chunk.final and chunk.finish_reason == "abort" and leases is not None:
                        # an abort it did not ask for (it cancels only once it has stopped reading, and nothing
                        # else cancels what a gateway relays): the worker let the request go, its lease having
                        # lapsed while this gateway (or Redis) stalled past the TTL
                        raise streams.OutputLost(f"request {sub.request_id}: its worker let it go, its lease having "
                                                 "lapsed while this gateway or Redis stalled (lease_ttl_s)")
                    if leases is not None:
                        leases.touch(sub.request_id)
                    observer.chunk(chunk)
                    finished = chunk.final
                    relayed.append(chunk)
                    yield chunk
                return
            except streams.OutputLost as e:
                redis_lost += 1
                if redis_lost > MAX_REPLACEMENTS:
                    raise
                log.warning("request %s: %s; placing it again", sub.request_id, e)
            except WorkerLost as e:
                worker_lost += 1
                if worker_lost >= settings.max_deliveries:
                    log.error("request %s: its worker was lost %d times: giving up", sub.request_id, worker_lost)
                    raise APIError(500, f"request {sub.request_id}: the workers running it were lost {worker_lost} "
                                        f"times (max_deliveries {settings.max_deliveries}); it may crash them",
                                   type="server_error", code="dead_letter") from None
                log.warning("request %s: %s; placing it again", sub.request_id, e)
            sub = await _place_again(state, sub, relayed, redis_lost + worker_lost)
            if relayed:
                restored.append(keys.out_stream(sub.request_id, sub.placement.shard))
    except streams.OutputTimeout:
        raise APIError(504, f"no output within {settings.request_timeout_s:g}s; the request was cancelled",
                       code="timeout") from None
    except streams.RedisOutage as e:
        log.warning("request %s: %s", sub.request_id, e)
        code = "redis_lost_request" if isinstance(e, streams.OutputLost) else "redis_unavailable"
        raise APIError(503, str(e), code=code, headers={"Retry-After": str(settings.retry_after_s)}) from None
    except streams.RedisError as e:  # any other Redis failure: an error the client sees, never a silent end
        log.warning("request %s: redis failed while relaying: %s", sub.request_id, e)
        raise APIError(503, f"the request queue (Redis) failed while relaying request {sub.request_id}: "
                            f"{type(e).__name__}: {e}; retry the request", code="redis_unavailable",
                       headers={"Retry-After": str(settings.retry_after_s)}) from None
    finally:
        state.let_go(sub.request_id)
        if leases is not None:  # the restored streams: not needed now
            for stream in restored:
                leases.expire_later(stream)
        if not finished:
            log.info("cancelling %s (client gone or timed out)", sub.request_id)
            state.spawn(_cancel(state, sub.request_id))


def _chunks(state: GatewayState, sub: Submitted, after_seq: int) -> AsyncIterator[OutputChunk]:
    settings, where, leases = state.settings, sub.placement, state.leases
    lost = (lambda: leases.is_lost(sub.request_id)) if leases is not None else None
    entry = (where.stream, where.entry_id)
    if state.inbox is not None:
        return state.inbox.chunks(sub.request_id, timeout_s=settings.request_timeout_s,
                                  grace_s=settings.redis_grace_s, lost=lost, after_seq=after_seq, entry=entry,
                                  stranded=lambda shard: _stranded(state, shard))
    return streams.aiter_output(state.redis, sub.request_id, where.shard, timeout_s=settings.request_timeout_s,
                                expire_after_s=settings.output_ttl_after_read_s, grace_s=settings.redis_grace_s,
                                entry=entry, after_seq=after_seq, lost=lost,
                                expire_later=leases.expire_later if leases is not None else None)


async def _stranded(state: GatewayState, shard: int) -> bool:
    """No live worker is left in `shard` (all of its workers died and none came back), while other shards have
    some: a request waiting there is placed again elsewhere (a request never leaves its shard on its own).
    With one shard, or none live anywhere, it waits for a worker to come back (kvfleet up restarts it)."""
    try:
        live = {w.shard for w in (await read_view(state.views, state.redis)).live}
    except streams.RedisError:
        return False  # unknown: the outage is handled on its own
    return bool(live) and shard not in live


async def _place_again(state: GatewayState, sub: Submitted, relayed: list[OutputChunk], n: int) -> Submitted:
    """Redis lost `sub`, or its worker: cancel it (a worker may still run it), and place it again under a new
    request id with the chunks relayed so far restored into its output stream (one attempt later, so its
    worker resumes after them)."""
    state.let_go(sub.request_id)
    await _cancel(state, sub.request_id)
    if state.inbox is not None:
        await state.inbox.ensure()
    planned = replan(state.settings, sub, f"{sub.request_id.split('~')[0]}~{n}")
    async with state.admission:
        again = await place(state, planned, restore=relayed)
    state.metrics.replaced.inc()
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("placed_again", {t.KVFLEET_REQUEST_ID: again.request_id,
                                        t.KVFLEET_RESUMED_TOKENS: sum(len(c.token_ids) for c in relayed)})
    log.warning("request %s placed again as %s (%s), resuming after %d chunk(s)", sub.request_id,
                again.request_id, again.placement.worker_id or "shared queue", len(relayed))
    return again


async def _cancel(state: GatewayState, request_id: str) -> None:
    try:
        await streams.acancel(state.redis, request_id)
    except streams.RedisError as e:  # Redis away: the worker finishes it for nobody
        log.warning("could not cancel %s: %s", request_id, e)


class RelayObserver:
    """Watches the chunks relayed for one request: gateway TTFT (metric and span event) at the first
    token, usage and finish reasons on the server span at the final chunk. Two checks per chunk."""

    def __init__(self, metrics: GatewayMetrics, sub: Submitted):
        self.metrics, self.sub = metrics, sub
        self.span = trace.get_current_span()
        self.first = True
        self.reasons: list[str] = []

    def chunk(self, chunk: OutputChunk) -> None:
        if self.first and chunk.token_ids:
            self.first = False
            ttft = max(0.0, time.time() - self.sub.request.arrival_time)
            self.metrics.observe_ttft(self.sub.target.model, ttft)
            if self.span.is_recording():
                self.span.set_attribute(t.KVFLEET_TTFT_S, ttft)
                self.span.add_event("first_token", {t.KVFLEET_TTFT_S: ttft, t.KVFLEET_WORKER_ID: chunk.worker_id})
        if chunk.finish_reason:
            self.reasons.append(chunk.finish_reason)
        if chunk.final and self.span.is_recording():
            attrs: dict[str, Any] = {t.GEN_AI_RESPONSE_FINISH_REASONS: self.reasons,
                                     t.GEN_AI_RESPONSE_MODEL: self.sub.target.model}
            if chunk.usage is not None:
                attrs |= {t.GEN_AI_USAGE_INPUT_TOKENS: chunk.usage.prompt_tokens,
                          t.GEN_AI_USAGE_OUTPUT_TOKENS: chunk.usage.completion_tokens,
                          t.KVFLEET_PREFIX_CACHE_HIT_TOKENS: chunk.usage.cached_tokens}
            self.span.set_attributes(attrs)
            if chunk.error is not None:
                t.set_error(self.span, chunk.error.message)
