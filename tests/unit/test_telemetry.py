"""shared/telemetry.py: off by default and free, W3C context through a dict carrier, spans with explicit
times, and the real SDK setup from the standard OTEL_* variables (exporting to an in-test OTLP receiver)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, SpanKind
from otlp_receiver import OtlpReceiver

from shared import telemetry
from shared.settings import otel_traces_export

pytestmark = pytest.mark.unit

OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
             "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_RESOURCE_ATTRIBUTES")


@pytest.fixture
def clean_env(monkeypatch):
    for v in OTEL_VARS:
        monkeypatch.delenv(v, raising=False)
    yield monkeypatch
    telemetry.shutdown()


@pytest.fixture
def memory_spans(clean_env):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    yield exporter


def test_export_settings_from_the_standard_variables():
    assert otel_traces_export({}) == (None, "http/protobuf")
    assert otel_traces_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ("http://c:4318", "http/protobuf")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/v1/traces",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert otel_traces_export(env) == ("http://t/v1/traces", "grpc")
    assert otel_traces_export(env | {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})[1] == "http/protobuf"
    assert otel_traces_export(env | {"OTEL_SDK_DISABLED": "true"})[0] is None
    assert otel_traces_export(env | {"OTEL_TRACES_EXPORTER": "none"})[0] is None


def test_off_without_an_endpoint_and_every_helper_is_a_no_op(clean_env):
    assert telemetry.setup_tracing("kvfleet-test") is False
    assert not telemetry.enabled()
    with telemetry.span("kvfleet.route", attributes={"a": 1}) as s:
        assert s is INVALID_SPAN
        assert telemetry.inject() == {}
    assert telemetry.start_span("x") is INVALID_SPAN
    assert telemetry.extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}) is None
    assert telemetry.record_span("x", INVALID_SPAN, 1, 2) is INVALID_SPAN


def test_context_travels_through_a_dict_carrier(memory_spans):
    with telemetry.span("gateway", kind=SpanKind.SERVER) as root:
        with telemetry.span("enqueue", kind=SpanKind.PRODUCER) as producer:
            carrier = telemetry.inject()
    assert set(carrier) == {"traceparent"}
    version, trace_id, span_id, flags = carrier["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert int(trace_id, 16) == root.get_span_context().trace_id
    assert int(span_id, 16) == producer.get_span_context().span_id

    parent = telemetry.extract(dict(carrier))  # e.g. GenerationRequest.trace_context after a JSON round trip
    consumer = telemetry.start_span("worker", context=parent, kind=SpanKind.CONSUMER,
                                    attributes={telemetry.KVFLEET_WORKER_ID: "w1", "dropped": None})
    child = telemetry.record_span("prefill", consumer, start_ns=1_000, end_ns=5_000,
                                  attributes={telemetry.GEN_AI_USAGE_INPUT_TOKENS: 7})
    consumer.end()
    spans = {s.name: s for s in memory_spans.get_finished_spans()}
    assert set(spans) == {"gateway", "enqueue", "worker", "prefill"}
    ids = {n: s.context.trace_id for n, s in spans.items()}
    assert len(set(ids.values())) == 1
    assert spans["worker"].parent.span_id == spans["enqueue"].context.span_id
    assert spans["worker"].parent.is_remote
    assert spans["prefill"].parent.span_id == spans["worker"].context.span_id
    assert (spans["prefill"].start_time, spans["prefill"].end_time) == (1_000, 5_000)
    assert spans["prefill"].attributes[telemetry.GEN_AI_USAGE_INPUT_TOKENS] == 7
    assert dict(spans["worker"].attributes) == {telemetry.KVFLEET_WORKER_ID: "w1"}
    assert child.get_span_context().trace_id == ids["gateway"]


def test_bad_or_empty_carriers_start_a_new_trace(memory_spans):
    assert telemetry.extract({}) is None
    assert telemetry.extract(None) is None
    assert telemetry.extract({"traceparent": "garbage"}) is None
    assert telemetry.extract({"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}) is None


def test_span_marks_an_exception_as_an_error(memory_spans):
    with pytest.raises(ValueError), telemetry.span("boom"):
        raise ValueError("no")
    (s,) = memory_spans.get_finished_spans()
    assert s.status.status_code.name == "ERROR"
    assert s.events[0].name == "exception"


def test_wall_ns_maps_the_monotonic_clock_to_epoch_ns():
    import time

    now_mono, now_ns = time.monotonic(), time.time_ns()
    assert abs(telemetry.wall_ns(now_mono) - now_ns) < 50_000_000
    assert abs(telemetry.wall_ns(now_mono - 2.0) - (now_ns - 2_000_000_000)) < 50_000_000


def test_grpc_only_with_its_package_else_says_what_to_do(clean_env):
    import importlib.util

    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        with pytest.raises(RuntimeError, match="opentelemetry-exporter-otlp-proto-grpc"):
            telemetry._exporter("grpc")
    else:
        assert "grpc" in type(telemetry._exporter("grpc")).__module__
    with pytest.raises(RuntimeError, match="http/protobuf"):
        telemetry._exporter("http/json")


def test_setup_from_env_exports_otlp_http_and_flushes_on_shutdown(clean_env):
    with OtlpReceiver() as rx:
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        assert telemetry.setup_tracing("kvfleet-unit") is True
        assert telemetry.setup_tracing("kvfleet-unit") is True  # idempotent
        with telemetry.span("kvfleet.test", attributes={telemetry.GEN_AI_SYSTEM: telemetry.SYSTEM}):
            pass
        telemetry.shutdown()  # BatchSpanProcessor: nothing is sent before a flush
        (s,) = rx.wait_for(lambda spans: len(spans) == 1, timeout_s=10)
        assert s.name == "kvfleet.test" and s.service_name == "kvfleet-unit"
        assert s.attributes == {"gen_ai.system": "kvfleet"}

        clean_env.setenv("OTEL_SERVICE_NAME", "my-gateway")
        clean_env.setenv("OTEL_TRACES_SAMPLER", "always_off")
        assert telemetry.setup_tracing("kvfleet-unit") is True
        with telemetry.span("sampled.out") as off:
            assert not off.is_recording()
            assert not int(telemetry.inject()["traceparent"][-2:], 16) & 1  # propagated, not sampled
        clean_env.setenv("OTEL_TRACES_SAMPLER", "always_on")
        telemetry.shutdown()
        assert telemetry.setup_tracing("kvfleet-unit") is True
        with telemetry.span("named"):
            pass
        telemetry.shutdown()
        spans = rx.wait_for(lambda spans: len(spans) == 2, timeout_s=10)
        assert [(s.name, s.service_name) for s in spans[1:]] == [("named", "my-gateway")]
