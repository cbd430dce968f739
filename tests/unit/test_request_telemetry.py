"""gpu_worker/request_telemetry.py with a stand-in engine: the spans and events one request gets on a worker
(from the engine's timestamps, at its boundaries), preemptions as events, the metrics it feeds, and nothing
but metrics when tracing is off."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpu_worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gpu_worker.serve.metrics import WorkerMetrics
from gpu_worker.serve.request_telemetry import RequestTelemetry
from gpu_worker.serve.request_tracker import Job
from shared import telemetry
from shared.messages import GenerationRequest, OutputChunk

pytestmark = pytest.mark.unit


class FakeKV:
    def __init__(self):
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, rid: str) -> list[int]:
        return self.blocks.get(rid, [])

    def num_blocks_for(self, n: int) -> int:
        return -(-n // 16)


def engine():
    return SimpleNamespace(scheduler=SimpleNamespace(num_preemptions=0, requests={}, kv_cache_manager=FakeKV()))


def job(rid: str = "r1", trace_context=None, sent=None, deliveries=1) -> Job:
    req = GenerationRequest(request_id=rid, prompt_token_ids=list(range(20)), model="tiny",
                            sampling_params={"max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "n": 1},
                            trace_context=trace_context or {})
    j = Job(request=req, stream="kvfleet:req:w0", entry_id="1-0", deliveries=deliveries)
    if sent:
        j.resume_from([OutputChunk(request_id=rid, seq=0, token_ids=sent)])
    else:
        j.sent_tokens, j.finished = [[]], [False]
    return j


def output(rid: str, tokens: list[int], m: RequestMetrics, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, None, list(range(20)), [CompletionOutput(0, "x", tokens, None, finish)],
                         finished=finish is not None, metrics=m)


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    yield exporter
    telemetry.shutdown()


def test_one_request_spans_events_and_metrics(spans):
    eng = engine()
    metrics = WorkerMetrics("tiny", "w0", lambda: None)
    rt = RequestTelemetry("w0", eng, metrics)
    with telemetry.span("enqueue") as parent:
        carrier = telemetry.inject()
    j = job(trace_context=carrier)
    rt.taken(j)
    now = time.monotonic()
    m = RequestMetrics(arrival_time=now - 0.5, first_scheduled_time=now - 0.3, first_token_time=now - 0.2)
    eng.scheduler.kv_cache_manager.blocks["r1"] = [3, 4]
    rt.output(j, output("r1", [7], m), [OutputChunk(request_id="r1", seq=0, token_ids=[7])], first=True)
    eng.scheduler.num_preemptions = 1  # preempted between steps
    eng.scheduler.requests["r1"] = SimpleNamespace(request_id="r1", num_preemptions=1, num_tokens=21)
    rt.after_step()
    rt.after_step()  # nothing new: no second event
    m.finished_time = now
    rt.output(j, output("r1", [8, 9, 10], m, "length"), [OutputChunk(request_id="r1", seq=1, token_ids=[8, 9, 10])],
              first=False)
    assert not rt.open

    by = {s.name: s for s in spans.get_finished_spans()}
    work = by["kvfleet.worker.request"]
    assert work.parent.span_id == parent.get_span_context().span_id
    assert {by[n].parent.span_id for n in ("kvfleet.queue_wait", "kvfleet.prefill", "kvfleet.decode")} == {
        work.context.span_id}
    a = work.attributes
    assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.usage.input_tokens"] == 20 and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["kvfleet.kv.blocks"] == 2
    assert a["kvfleet.queue.wait_s"] == pytest.approx(0.2) and a["kvfleet.ttft_s"] == pytest.approx(0.3)
    assert [e.name for e in work.events] == ["admitted", "first_token", "preempted"]
    assert work.end_time - by["kvfleet.decode"].start_time == pytest.approx(0.2e9, rel=0.01)
    assert by["kvfleet.prefill"].end_time == by["kvfleet.decode"].start_time
    assert metrics.generation_tokens == 4
    assert metrics.ttft._sum.get() == pytest.approx(0.3)
    assert metrics.itl._sum.get() == pytest.approx(0.2 / 3)


def test_ended_requests_and_takeovers(spans):
    eng = engine()
    metrics = WorkerMetrics("tiny", "w0", lambda: None)
    rt = RequestTelemetry("w0", eng, metrics)
    rt.taken(job("cancelled"))
    rt.ended("cancelled", "abort")
    rt.taken(job("bad"))
    rt.ended("bad", "error", error="prompt too long")
    taken_over = job("moved", sent=[5, 6, 7], deliveries=2)
    rt.taken(taken_over)
    now = time.monotonic()
    m = RequestMetrics(now - 9, now - 0.1, now - 0.05, now)
    rt.output(taken_over, output("moved", [8], m, "length"),
              [OutputChunk(request_id="moved", seq=1, token_ids=[8])], first=True)
    by = {s.attributes["kvfleet.request.id"]: s for s in spans.get_finished_spans()
          if s.name == "kvfleet.worker.request"}
    assert by["cancelled"].attributes["kvfleet.end"] == "abort" and by["cancelled"].status.is_ok
    assert by["bad"].status.status_code.name == "ERROR"
    moved = by["moved"].attributes
    assert moved["kvfleet.resumed_tokens"] == 3 and moved["kvfleet.deliveries"] == 2
    assert "kvfleet.ttft_s" not in moved  # the first token was sent by the dead worker
    assert metrics.ttft._sum.get() == 0 and metrics.redeliveries._value.get() == 1
    assert metrics.generation_tokens == 1  # only what this worker generated


def test_tracing_off_records_metrics_only():
    telemetry.shutdown()
    eng = engine()
    metrics = WorkerMetrics("tiny", "w0", lambda: None)
    rt = RequestTelemetry("w0", eng, metrics)
    j = job(trace_context={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    rt.taken(j)
    assert not rt.open
    now = time.monotonic()
    m = RequestMetrics(now - 1, now - 0.5, now - 0.25, now)
    rt.output(j, output("r1", [1, 2], m, "stop"), [OutputChunk(request_id="r1", seq=0, token_ids=[1, 2])], first=True)
    eng.scheduler.num_preemptions = 3
    rt.after_step()
    assert metrics.generation_tokens == 2 and metrics.e2e._sum.get() == pytest.approx(1.0)
    assert metrics.prompt_tokens._value.get() == 20
