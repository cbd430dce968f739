"""The metric names the worker and the gateway expose: exactly vLLM's where vLLM has one (no doubled
_total), kvfleet_* otherwise, and every name the Grafana dashboard charts is one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gpu_worker.core.scheduler import SchedulerStats
from gpu_worker.engine.outputs import RequestMetrics
from gpu_worker.serve.metrics import WorkerMetrics

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def stats(**kw) -> SchedulerStats:
    base = dict(total_blocks=64, free_blocks=60, used_blocks=4, cached_blocks=2, prefix_cache_queries=40,
                prefix_cache_hits=16, allocated_slots=64, stored_tokens=50, fragmentation_slots=14,
                num_running=1, num_waiting=2, num_preemptions=3)
    return SchedulerStats(**(base | kw))


def samples(registry) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, through prometheus_client's own text parser."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def names(registry) -> set[str]:
    return {n for n, _ in samples(registry)}


def test_worker_exposes_vllm_names_with_model_and_worker_labels():
    current = stats()
    m = WorkerMetrics("tiny", "w1", lambda: current)
    m.first_token(prompt_tokens=12, ttft_s=0.25)
    m.generation_tokens += 5
    m.finished(RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                              finished_time=13.0, num_cached_tokens=0), output_tokens=5, finish_reasons=["length"])
    m.redeliveries.inc()
    got = samples(m.registry)
    lv = (("model_name", "tiny"), ("worker", "w1"))
    expect = {
        "vllm:num_requests_running": 1, "vllm:num_requests_waiting": 2, "vllm:kv_cache_usage_perc": 4 / 64,
        "vllm:num_preemptions_total": 3, "vllm:prefix_cache_queries_total": 40, "vllm:prefix_cache_hits_total": 16,
        "vllm:prompt_tokens_total": 12, "vllm:generation_tokens_total": 5, "kvfleet_kv_free_blocks": 60,
        "kvfleet_kv_total_blocks": 64, "kvfleet_redeliveries_total": 1, "kvfleet_dead_letters_total": 0,
        "vllm:time_to_first_token_seconds_count": 1, "vllm:time_to_first_token_seconds_sum": 0.25,
        "vllm:e2e_request_latency_seconds_sum": 3.0, "vllm:request_queue_time_seconds_sum": 0.5,
        "vllm:inter_token_latency_seconds_sum": 0.5,  # 2 s of decode over 4 gaps
    }
    for name, value in expect.items():
        assert got[(name, lv)] == pytest.approx(value), name
    assert got[("vllm:request_success_total", tuple(sorted(lv + (("finished_reason", "length"),))))] == 1
    assert not any(n.endswith("_total_total") for n in names(m.registry))
    assert m.recent() == {"ttft_p50_s": 0.25, "ttft_p95_s": 0.25, "ttft_p99_s": 0.25, "generation_tokens": 5.0}

    current = stats(free_blocks=10, used_blocks=54, num_running=4, num_waiting=0)  # scrape-time values
    got = samples(m.registry)
    assert got[("kvfleet_kv_free_blocks", lv)] == 10 and got[("vllm:num_requests_running", lv)] == 4


def test_worker_before_its_first_stats_and_percentiles():
    m = WorkerMetrics("tiny", "w1", lambda: None)
    assert "vllm:num_requests_running" not in names(m.registry)
    for i in range(100):
        m.first_token(1, ttft_s=(i + 1) / 100)
    assert m.recent()["ttft_p50_s"] == pytest.approx(0.51)
    assert m.recent()["ttft_p99_s"] == pytest.approx(1.0)


def test_gateway_metrics_and_fleet_gauges():
    g = GatewayMetrics()
    g.observe_http("/v1/chat/completions", 200, 0.5)
    g.observe_http("/v1/chat/completions", 429, 0.01)
    g.routed("free_blocks", "w1")
    g.routed("free_blocks", None)
    g.ttft.labels("tiny").observe(0.1)
    g.refresh({
        "workers": [{"worker_id": "w1", "model": "tiny", "free_blocks": 5, "total_blocks": 8}],
        "dead_workers": ["w0"], "streams": {"kvfleet:req:any": {"length": 3, "pending": 1}},
        "dead_letters": 2})
    got = samples(g.registry)
    assert got[("kvfleet_http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "429")))] == 1
    assert got[("kvfleet_rejected_total", ())] == 1
    assert got[("kvfleet_routing_decisions_total", (("policy", "free_blocks"), ("worker", "any")))] == 1
    assert got[("kvfleet_stream_length", (("stream", "kvfleet:req:any"),))] == 3
    assert got[("kvfleet_stream_pending", (("stream", "kvfleet:req:any"),))] == 1
    assert got[("kvfleet_stream_lag", (("stream", "kvfleet:req:any"),))] == 2
    assert got[("kvfleet_fleet_free_blocks", (("model_name", "tiny"), ("worker", "w1")))] == 5
    assert got[("kvfleet_fleet_workers", (("state", "dead"),))] == 1
    assert got[("kvfleet_dead_letter_stream_length", ())] == 2
    # the gateway never exports a worker's name: a sum over all targets counts each thing once
    worker_names = names(WorkerMetrics("tiny", "w1", stats).registry)
    assert not {n for n in names(g.registry) if n.startswith(("vllm:", "kvfleet_"))} & worker_names


def test_every_metric_the_dashboard_charts_is_exported():
    m = WorkerMetrics("tiny", "w1", stats)
    m.success.labels("tiny", "w1", "stop").inc()
    g = GatewayMetrics()
    g.routed("free_blocks", None)  # the shared stream: a worker's series would go with it (it is not in the fleet)
    g.refresh({"workers": [], "dead_workers": [], "streams": {"s": {"length": 0, "pending": 0}},
               "dead_letters": 0})
    exported = names(m.registry) | names(g.registry)
    dashboard = json.loads(DASHBOARD.read_text())
    charted = {n for p in dashboard["panels"] for t in p.get("targets", [])
               for n in re.findall(r"\b(?:vllm:|kvfleet_)[a-z0-9_:]+", t["expr"])}
    assert charted, "the dashboard charts nothing"
    assert charted <= exported, charted - exported
