"""Observability of a real fleet (Redis, a worker process on the tiny model, a gateway process):
  - one request -> one trace: the gateway's server, route and enqueue spans and the worker's spans, in
    parent/child order, exported over OTLP/HTTP to a receiver inside the test, with the GenAI attributes;
  - /metrics on the gateway and on the worker's --metrics-port move while requests run;
  - `kvfleet top --once` shows the worker and the streams;
  - a request whose worker is killed mid-stream finishes on another worker, in the same trace;
  - with no endpoint set, nothing is exported and everything still works."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fleet_harness import API_KEY, REPO, Fleet
from otlp_receiver import OtlpReceiver
from prometheus_client.parser import text_string_to_metric_families

from services.ports import free_port

pytestmark = pytest.mark.integration

BLOCKS = 48
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SERVER, PRODUCER, CONSUMER, INTERNAL = 2, 4, 5, 1  # OTLP SpanKind


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory, receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "KVFLEET_STATUS_TTL_S": "2", "KVFLEET_HEARTBEAT_S": "0.5"}  # a killed worker is dead within 2 s
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("observability"), env=env) as f:
        f.metrics_port = free_port()
        f.start_worker("w0", "--num-kv-blocks", str(BLOCKS), "--max-num-seqs", "2",
                       "--metrics-port", str(f.metrics_port))
        f.start_gateway()
        f.wait_ready(workers=1)
        yield f


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)\
        .raise_for_status().text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name` over the series whose labels include `labels`."""
    want = set(labels.items())
    found = [v for (n, lv), v in samples.items() if n == name and want <= lv]
    assert found, f"{name}{labels} not exported"
    return sum(found)


def test_one_request_is_one_trace_from_gateway_to_worker(fleet, receiver):
    client = fleet.client(timeout=60)
    model = os.path.basename(fleet.model)
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Trace me, please."}], max_tokens=6, temperature=0.5,
        top_p=0.9, extra_body={"ignore_eos": True},
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    names = {"kvfleet.route", "kvfleet.enqueue", "kvfleet.worker.request", "kvfleet.queue_wait", "kvfleet.prefill",
             "kvfleet.decode", "POST /v1/chat/completions"}

    def complete(spans) -> bool:
        return names <= {s.name for s in spans if s.trace_id == TRACE_ID}

    spans = [s for s in receiver.wait_for(complete, timeout_s=20) if s.trace_id == TRACE_ID]
    by = {s.name: s for s in spans}
    assert len(spans) == len(by), sorted(s.name for s in spans)  # each once: one trace, one request
    server, route, enqueue = by["POST /v1/chat/completions"], by["kvfleet.route"], by["kvfleet.enqueue"]
    work = by["kvfleet.worker.request"]
    # parent/child: caller -> gateway server -> route, enqueue -> worker request -> queue wait, prefill, decode
    assert server.parent_span_id == PARENT_ID and server.kind == SERVER
    assert route.parent_span_id == server.span_id and enqueue.parent_span_id == server.span_id
    assert enqueue.kind == PRODUCER and route.end_ns <= enqueue.start_ns
    assert work.parent_span_id == enqueue.span_id and work.kind == CONSUMER
    for child in ("kvfleet.queue_wait", "kvfleet.prefill", "kvfleet.decode"):
        assert by[child].parent_span_id == work.span_id, child
    assert by["kvfleet.queue_wait"].end_ns <= by["kvfleet.prefill"].start_ns <= by["kvfleet.prefill"].end_ns
    assert by["kvfleet.prefill"].end_ns <= by["kvfleet.decode"].start_ns <= by["kvfleet.decode"].end_ns
    assert enqueue.start_ns <= work.start_ns and work.end_ns <= server.end_ns
    assert {server.service_name, work.service_name} == {"kvfleet-gateway", "kvfleet-worker"}

    a = server.attributes
    assert a["gen_ai.system"] == "kvfleet" and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == model and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["http.response.status_code"] == 200 and a["http.route"] == "/v1/chat/completions"
    assert a["kvfleet.ttft_s"] > 0 and a["kvfleet.worker.id"] == "w0"
    r = route.attributes
    assert r["kvfleet.routing.policy"] == "free_blocks" and r["kvfleet.worker.id"] == "w0"
    assert 0 < r["kvfleet.routing.free_blocks"] <= BLOCKS and r["kvfleet.kv.blocks"] >= 1
    assert enqueue.attributes["messaging.destination.name"] == "kvfleet:{s0}:req:w0"
    w = work.attributes
    assert w["kvfleet.worker.id"] == "w0" and w["gen_ai.request.model"] == model
    assert w["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens and w["gen_ai.usage.output_tokens"] == 6
    assert w["gen_ai.response.finish_reasons"] == ["length"] and w["gen_ai.request.max_tokens"] == 6
    assert w["kvfleet.kv.blocks"] >= 1 and w["kvfleet.prefix_cache.hit_tokens"] >= 0
    assert 0 <= w["kvfleet.queue.wait_s"] < 30 and 0 < w["kvfleet.ttft_s"] < 30
    assert [e for e, _ in work.events] == ["admitted", "first_token"]
    assert by["kvfleet.prefill"].attributes["kvfleet.kv.blocks"] == w["kvfleet.kv.blocks"]


# tokens per request: long enough that the poller (a scrape every ~20 ms) sees the two running together on a busy
# CI machine (48 took the tiny model ~0.1 s, and a run once saw at most one running)
TOKENS = 160


def test_metrics_move_while_requests_run(fleet):
    gw, wk = fleet.url(), f"http://127.0.0.1:{fleet.metrics_port}"
    before = scrape(wk)
    assert value(before, "kvfleet_kv_free_blocks", worker="w0") == BLOCKS
    assert value(before, "kvfleet_kv_total_blocks", worker="w0") == BLOCKS
    assert value(before, "vllm:num_requests_running") == 0
    client = fleet.client(timeout=120)
    model = os.path.basename(fleet.model)

    def one(i: int):
        return client.completions.create(model=model, prompt=f"Request {i}: tell me a long story about", max_tokens=TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True})

    seen = {"running": 0.0, "waiting": 0.0, "min_free": float(BLOCKS), "usage": 0.0}
    with ThreadPoolExecutor(4) as pool:  # 4 requests, 2 sequences at a time: 2 run, 2 wait
        futures = [pool.submit(one, i) for i in range(4)]
        while not all(f.done() for f in futures):
            s = scrape(wk)
            seen["running"] = max(seen["running"], value(s, "vllm:num_requests_running"))
            seen["waiting"] = max(seen["waiting"], value(s, "vllm:num_requests_waiting"))
            seen["min_free"] = min(seen["min_free"], value(s, "kvfleet_kv_free_blocks"))
            seen["usage"] = max(seen["usage"], value(s, "vllm:kv_cache_usage_perc"))
            time.sleep(0.02)
        results = [f.result() for f in futures]
    assert all(r.usage.completion_tokens == TOKENS for r in results)
    assert seen["running"] == 2 and seen["waiting"] >= 1, seen
    assert seen["min_free"] < BLOCKS and seen["usage"] > 0, seen

    def settled():
        s = scrape(wk)
        return s if value(s, "kvfleet_kv_free_blocks") == BLOCKS and value(s, "vllm:num_requests_running") == 0 \
            else None

    after = fleet.wait_for(settled, what="free blocks back up")
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    gen = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert gen == 4 * TOKENS
    prompt = value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total")
    assert prompt == sum(r.usage.prompt_tokens for r in results)
    assert value(after, "vllm:request_success_total", finished_reason="length") >= 4
    assert value(after, "vllm:e2e_request_latency_seconds_count") >= 5
    assert value(after, "vllm:time_to_first_token_seconds_count") >= 5
    assert value(after, "vllm:prefix_cache_queries_total") >= prompt
    assert value(after, "vllm:inter_token_latency_seconds_count") >= 4

    def gateway_settled():  # its view of the fleet is the worker's last published status (every heartbeat)
        s = scrape(gw)
        return s if value(s, "kvfleet_fleet_free_blocks", worker="w0") == BLOCKS else None

    g = fleet.wait_for(gateway_settled, what="the gateway's view of w0's free blocks back up")
    assert value(g, "kvfleet_http_requests_total", endpoint="/v1/completions", status="200") == 4
    assert value(g, "kvfleet_routing_decisions_total", policy="free_blocks", worker="w0") >= 5
    assert value(g, "kvfleet_gateway_time_to_first_token_seconds_count") >= 5
    assert value(g, "kvfleet_rejected_total") == 0
    assert value(g, "kvfleet_stream_length", stream="kvfleet:{s0}:req:w0") == 0
    assert value(g, "kvfleet_stream_pending", stream="kvfleet:{s0}:req:any") == 0
    assert value(g, "kvfleet_fleet_free_blocks", worker="w0") == BLOCKS
    assert value(g, "kvfleet_fleet_workers", state="live") == 1


def test_top_once_shows_the_fleet(fleet):
    out = subprocess.run([sys.executable, "-m", "services.cli", "top", "--once", "--interval", "0.3"], cwd=REPO,
                         env=fleet.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("w0 ")]
    assert f"{BLOCKS}/{BLOCKS}" in row and "[....................]" in row
    ttft = row.split()[-3]  # "p50/p95/p99" in ms, from the requests above
    assert all(x.isdigit() for x in ttft.split("/")), row
    assert any(line.startswith("kvfleet:{s0}:req:any") for line in out.stdout.splitlines())
    assert "p@ss:word" not in out.stdout + out.stderr


@pytest.mark.parametrize("how", ["q", "ctrl-c"])
def test_top_live_view_exits_cleanly(fleet, how):
    pid, fd = pty.fork()  # curses needs a terminal
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-m", "services.cli", "top", "--interval", "0.2"],
                  dict(fleet.env, TERM="xterm"))
    screen = b""

    def read(timeout_s: float) -> None:
        nonlocal screen
        if select.select([fd], [], [], timeout_s)[0]:
            with contextlib.suppress(OSError):
                screen += os.read(fd, 65536)

    try:
        deadline = time.monotonic() + 30
        while b"w0" not in screen and time.monotonic() < deadline:
            read(0.2)
        assert b"kvfleet top" in screen and b"w0" in screen, screen[-2000:]
        if how == "q":
            os.write(fd, b"q")
        else:
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 10
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            read(0.1)
        assert done[0] == pid, "kvfleet top did not exit"
        assert os.waitstatus_to_exitcode(done[1]) == 0
        pid = 0
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_a_request_taken_over_after_a_crash_stays_in_its_trace(fleet, receiver):
    fleet.start_worker("w1", "--num-kv-blocks", str(BLOCKS), "--max-num-seqs", "2")
    fleet.wait_ready(workers=2)
    trace_id = "5a1e" * 8
    raw = fleet.client(timeout=120).completions.with_raw_response.create(
        model=os.path.basename(fleet.model), prompt="A long story:", max_tokens=300, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-01"})
    victim = raw.headers["x-kvfleet-worker"]
    survivor = ({"w0", "w1"} - {victim}).pop()
    events, usage = 0, None
    for event in raw.parse():
        if event.choices:
            events += 1
            if events == 5:
                fleet.signal_worker(victim, signal.SIGKILL)
            finish = event.choices[0].finish_reason
        usage = event.usage or usage
    # every token once (an event may carry several: those that piled up while the client read)
    assert finish == "length" and usage is not None and usage.completion_tokens == 300

    def finished(spans) -> bool:
        return any(s.trace_id == trace_id and s.name.startswith("POST") for s in spans) and any(
            s.trace_id == trace_id and s.name == "kvfleet.decode" for s in spans)

    spans = [s for s in receiver.wait_for(finished, timeout_s=30) if s.trace_id == trace_id]
    # the survivor took the entry over and handed it back to the gateway, which placed it again (a second
    # enqueue, the chunks it relayed restored): the survivor's work hangs under that enqueue, in the same trace
    first, again = sorted((s for s in spans if s.name == "kvfleet.enqueue"), key=lambda s: s.start_ns)
    (work,) = [s for s in spans if s.name == "kvfleet.worker.request"]  # the killed worker's never ended
    a = work.attributes
    assert a["kvfleet.worker.id"] == survivor and work.parent_span_id == again.span_id
    assert a["kvfleet.attempt"] >= 1 and a["kvfleet.resumed_tokens"] >= 5
    assert first.start_ns < again.start_ns
    server = next(s for s in spans if s.name.startswith("POST"))
    assert any(name == "placed_again" for name, _ in server.events), server.events
    assert a["gen_ai.usage.output_tokens"] == 300 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert "kvfleet.ttft_s" not in a  # a resumed request's first token here is no time to first token
    assert server.attributes["gen_ai.usage.output_tokens"] == 300
    redelivered = value(scrape(f"http://127.0.0.1:{fleet.metrics_port}"), "kvfleet_redeliveries_total") \
        if survivor == "w0" else None
    assert redelivered in (None, 1)


def test_without_an_endpoint_nothing_is_exported_and_all_works(fleet, receiver):
    """A second worker and gateway on the same Redis without OTEL_*: the traced workers stop first, so the
    request can only be served by the untraced pair."""
    for proc in fleet.workers.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(30) == 0
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY"):
        fleet.env.pop(name)
    time.sleep(0.5)  # the traced processes' last spans
    exported = receiver.requests
    quiet = fleet.start_worker("w-quiet", "--num-kv-blocks", str(BLOCKS))
    port = fleet.start_gateway()

    def ready() -> bool:
        assert quiet.poll() is None, fleet.tail()
        try:
            return httpx.get(fleet.url(port) + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    fleet.wait_for(ready, timeout_s=120, what="the untraced worker and gateway")
    out = fleet.client(port, timeout=60).completions.create(
        model=os.path.basename(fleet.model), prompt="No tracing here", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert out.usage.completion_tokens == 5
    gw = fleet.gateways.pop(port)
    for proc in (quiet, gw):  # their exit would flush any buffered span
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
    fleet.workers.pop("w-quiet")
    time.sleep(0.3)
    assert receiver.requests == exported


def test_a_placement_outside_http_is_one_trace_with_its_root(tiny_llama_dir):
    """services.fleet_calls (Celery tasks, the client, batch files): the placement is a root span with the GenAI
    attributes, parent of the route and enqueue spans, and the enqueued request carries its trace. No fleet
    worker: with scale-to-zero queueing the request waits in the shared stream."""
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.fleet_calls import FleetCaller
    from services.redis_server import RedisServer
    from shared import keys, streams, telemetry
    from shared.settings import Settings

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)

    async def place(url: str) -> None:
        caller = FleetCaller(Settings(redis_url=url, model=str(tiny_llama_dir), queue_when_no_workers=True))
        try:
            await caller.submit("completion", {"prompt": "Hello there", "max_tokens": 3}, "task-1")
        finally:
            await caller.aclose()

    try:
        with RedisServer() as srv:
            asyncio.run(place(srv.url))
            r = streams.connect(srv.url)
            (_, fields), = r.xrange(keys.req_any())
            request = streams.parse_request(fields)
            r.close()
    finally:
        telemetry.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, route, enqueue = spans["kvfleet.submit"], spans["kvfleet.route"], spans["kvfleet.enqueue"]
    assert root.parent is None and route.parent.span_id == enqueue.parent.span_id == root.context.span_id
    assert {route.context.trace_id, enqueue.context.trace_id} == {root.context.trace_id}
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.request.model"] == str(tiny_llama_dir)
    assert attrs["kvfleet.request.id"] == "task-1" and attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["kvfleet.worker.id"] == "any" and enqueue.attributes["messaging.destination.name"] == keys.req_any()
    assert request.request_id == "task-1"
    assert request.trace_context["traceparent"].split("-")[1:3] == [f"{root.context.trace_id:032x}",
                                                                     f"{enqueue.context.span_id:016x}"]
