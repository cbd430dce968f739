"""OpenTelemetry tracing for kvfleet: SDK setup from the standard OTEL_* variables, W3C trace context in and
out of the Redis stream entry, and span helpers for the boundaries (request, route, enqueue, admission,
prefill, decode, finish).

With no OTLP endpoint set (OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) nothing is
configured: `enabled()` is False, the helpers return at once without touching the SDK, and `inject` gives
an empty carrier, so a fleet without tracing pays nothing for it.

The provider stays kvfleet's own (it is not installed as OTel's global one), so a trace holds kvfleet's
boundary spans only: libraries that trace themselves when a global provider exists (FastAPI's native
telemetry adds a server span plus dependency and endpoint spans to every request) stay off, at no cost.

Spans made after the fact (a request's prefill and decode, from the engine's timestamps when it finishes)
take explicit times: `record_span(..., start_ns=..., end_ns=...)`, with `wall_ns` turning the engine's
monotonic clock into the epoch nanoseconds OTel wants.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.settings import otel_traces_export

log = logging.getLogger("kvfleet.telemetry")

# ---- attribute names: GenAI semantic conventions, then kvfleet's own ----------------------------------
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
SYSTEM = "kvfleet"  # the value of gen_ai.system

KVFLEET_REQUEST_ID = "kvfleet.request.id"
KVFLEET_WORKER_ID = "kvfleet.worker.id"
KVFLEET_KV_BLOCKS = "kvfleet.kv.blocks"  # blocks routed (gateway) / allocated at admission (worker)
KVFLEET_QUEUE_WAIT_S = "kvfleet.queue.wait_s"  # gateway enqueue -> first scheduled
KVFLEET_TTFT_S = "kvfleet.ttft_s"  # gateway arrival -> first token
KVFLEET_ROUTING_POLICY = "kvfleet.routing.policy"
KVFLEET_ROUTING_FREE_BLOCKS = "kvfleet.routing.free_blocks"  # what the router saw on the chosen worker
KVFLEET_PREFIX_CACHE_HIT_TOKENS = "kvfleet.prefix_cache.hit_tokens"
KVFLEET_ATTEMPT = "kvfleet.attempt"  # times the request was handed back / re-enqueued
KVFLEET_DELIVERIES = "kvfleet.deliveries"  # Redis deliveries of the stream entry (> 1: taken over)
KVFLEET_RESUMED_TOKENS = "kvfleet.resumed_tokens"  # tokens a dead worker had sent, recomputed here
MESSAGING_SYSTEM = "messaging.system"  # "redis"
MESSAGING_DESTINATION = "messaging.destination.name"  # the stream

_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_provider: Any = None  # the SDK TracerProvider once configured; None: tracing off
_tracer: Any = None


def setup_tracing(default_service_name: str) -> bool:
    """Configure the OTel SDK when an OTLP endpoint is set; True when tracing is on. Idempotent.

    The exporter, sampler (OTEL_TRACES_SAMPLER, default parentbased_always_on), batch processor (OTEL_BSP_*)
    and resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) all come from the standard variables;
    `default_service_name` is used only when OTEL_SERVICE_NAME is not set."""
    endpoint, protocol = otel_traces_export()
    if endpoint is None:
        return False
    with _lock:
        if _provider is not None:
            return True
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create()
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
        provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER(_ARG)
        provider.add_span_processor(BatchSpanProcessor(_exporter(protocol)))
        install(provider)  # not the global provider: see the module doc
    log.info("tracing on: OTLP %s to %s as %s", protocol, endpoint, resource.attributes.get(SERVICE_NAME))
    return True


def _exporter(protocol: str) -> Any:
    """The OTLP span exporter for `protocol`; it reads its endpoint, headers and timeout from OTEL_*."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise RuntimeError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the package "
                               "opentelemetry-exporter-otlp-proto-grpc; install it, or set "
                               "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (port 4318)") from None
        return OTLPSpanExporter()
    raise RuntimeError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use http/protobuf "
                       "(or grpc with opentelemetry-exporter-otlp-proto-grpc installed)")


def install(provider: Any) -> None:
    """Trace through `provider` (an SDK TracerProvider). setup_tracing calls it; tests call it with a
    provider that exports to memory."""
    global _provider, _tracer
    _provider, _tracer = provider, provider.get_tracer("kvfleet")


def enabled() -> bool:
    return _provider is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export what is buffered now (an ASGI app's shutdown: uvicorn re-raises SIGTERM once it has stopped,
    so nothing after `uvicorn.run` runs, not even atexit hooks)."""
    provider = _provider
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))


def shutdown(timeout_s: float = 5.0) -> None:
    """Export what is buffered, then stop the exporter (the SDK also does this at interpreter exit)."""
    global _provider, _tracer
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


# ---- W3C trace context through the stream entry ---------------------------------------------------------

def inject(context: Context | None = None) -> dict[str, str]:
    """The current (or given) span context as a W3C carrier ({"traceparent": ..., "tracestate": ...});
    empty when tracing is off or there is no valid span."""
    carrier: dict[str, str] = {}
    if _provider is not None:
        _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote parent carried by `carrier` (headers or a GenerationRequest.trace_context); None when off,
    empty or unparsable (a span started with context None then starts a new trace)."""
    if _provider is None or not carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# ---- spans --------------------------------------------------------------------------------------------

def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (what OTel timestamps are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def start_span(name: str, *, context: Context | None = None, parent: Span | None = None,
               kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
               start_ns: int | None = None) -> Span:
    """A started span the caller ends (`span.end(end_time=...)`); INVALID_SPAN (a no-op) when off.
    `parent` (a span) wins over `context`; with neither, the current context is the parent."""
    if _provider is None:
        return INVALID_SPAN
    if parent is not None:
        context = trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=context, kind=kind, attributes=_clean(attributes),
                               start_time=start_ns)


_OFF = contextlib.nullcontext(INVALID_SPAN)


def span(name: str, *, context: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Span]:
    """`with span("kvfleet.route") as s:` — a current span around a block; exceptions mark it as an error.
    When off this gives INVALID_SPAN and costs one check (no generator per span on the request path)."""
    if _provider is None:
        return _OFF
    return _tracer.start_as_current_span(name, context=context, kind=kind, attributes=_clean(attributes))


def record_span(name: str, parent: Span, start_ns: int, end_ns: int,
                attributes: Mapping[str, Any] | None = None) -> Span:
    """A finished child span of `parent` with explicit times (from timestamps taken while it ran)."""
    if _provider is None or not parent.is_recording():
        return INVALID_SPAN
    child = start_span(name, parent=parent, attributes=attributes, start_ns=start_ns)
    child.end(end_time=max(start_ns, end_ns))
    return child


def set_error(s: Span, message: str) -> None:
    if s.is_recording():
        s.set_status(Status(StatusCode.ERROR, message))


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """OTel rejects None values: drop them."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
