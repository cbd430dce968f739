"""The gateway's request-level telemetry: an ASGI middleware that counts and times every HTTP request
(gateway.metrics) and, when tracing is on, wraps it in a SERVER span that continues an incoming W3C
`traceparent`; and `RelayObserver`, which marks the first token and the usage of one generation on that span.

The routing and enqueue spans are made where routing happens (gateway.fleet.place); the worker continues
the trace from the context the enqueue span injects into the stream entry.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from gateway.metrics import GatewayMetrics
from shared import telemetry as t

OPERATIONS = {"chatcmpl": "chat", "cmpl": "text_completion"}  # request id prefix -> gen_ai.operation.name


class Instrumentation:
    """`app.add_middleware(Instrumentation, metrics=...)`."""

    def __init__(self, app: Any, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if t.enabled():
                await self._traced(scope, receive, send_status, lambda: status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe_http(_endpoint(scope), status, time.perf_counter() - start)

    async def _traced(self, scope: dict, receive: Any, send: Any, status: Any) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        method = scope.get("method", "GET")
        with t.span(f"{method} {scope.get('path', '')}", context=t.extract(headers), kind=SpanKind.SERVER,
                    attributes={"http.request.method": method, "url.path": scope.get("path", ""),
                                "url.scheme": scope.get("scheme", "http")}) as span:
            try:
                await self.app(scope, receive, send)
            finally:
                route = _endpoint(scope)
                span.update_name(f"{method} {route}")
                span.set_attributes({"http.route": route, "http.response.status_code": status()})
                if status() >= 500:
                    t.set_error(span, f"HTTP {status()}")


def _endpoint(scope: dict) -> str:
    """The route template (bounded label values); "unmatched" for paths no route serves."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def note_route(span: Any, worker_id: str | None, candidates: list[Any], reservations: dict[str, int]) -> None:
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
def enqueue_span(request: Any, stream: str) -> Iterator[Any]:
    """A PRODUCER span around the XADD, whose context goes into the request (so into the stream entry):
    the worker that takes the entry, or a later one after a crash, continues the trace from it."""
    with t.span("kvfleet.enqueue", kind=SpanKind.PRODUCER,
                attributes={t.MESSAGING_SYSTEM: "redis", t.MESSAGING_DESTINATION: stream,
                            t.KVFLEET_REQUEST_ID: request.request_id}) as span:
        request.trace_context = t.inject()
        yield span


def annotate_request(sub: Any) -> None:
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


class RelayObserver:
    """Watches the chunks relayed for one request: gateway TTFT (metric and span event) at the first
    token, usage and finish reasons on the server span at the final chunk. Two checks per chunk."""

    def __init__(self, metrics: GatewayMetrics, sub: Any):
        self.metrics, self.sub = metrics, sub
        self.span = trace.get_current_span()
        self.first = True
        self.reasons: list[str] = []

    def chunk(self, chunk: Any) -> None:
        if self.first and chunk.token_ids:
            self.first = False
            ttft = max(0.0, time.time() - self.sub.request.arrival_time)
            self.metrics.ttft.labels(self.sub.target.model).observe(ttft)
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
