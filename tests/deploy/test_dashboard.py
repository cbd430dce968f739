"""deploy/grafana-dashboard.json: loads, and charts exactly the metric names kvfleet exports (issue 6):
vLLM's names where one exists, plus kvfleet_*."""

from __future__ import annotations

import json
import re

import pytest
from deploy_checks import REPO

pytestmark = pytest.mark.deploy

VLLM = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
}
KVFLEET = {
    "kvfleet_kv_free_blocks", "kvfleet_kv_total_blocks", "kvfleet_routing_decisions_total",
    "kvfleet_stream_length", "kvfleet_stream_pending", "kvfleet_redeliveries_total",
    "kvfleet_dead_letters_total", "kvfleet_rejected_total",
}
HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text())


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_charts_every_metric_and_only_real_ones(dashboard):
    used = set()
    for expr in exprs(dashboard):
        for name in re.findall(r"\b(?:vllm:|kvfleet_)[a-z0-9_:]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base != name:
                assert base in HISTOGRAMS, f"{name}: only histograms have _bucket/_sum/_count"
            used.add(base)
    assert used == VLLM | KVFLEET, (used - VLLM - KVFLEET, (VLLM | KVFLEET) - used)
    quantiles = [e for e in exprs(dashboard) if "histogram_quantile" in e]
    assert len(quantiles) == 3 * len(HISTOGRAMS)  # p50, p95, p99 of each
    for expr in quantiles:
        (series,) = re.findall(r"^histogram_quantile\(0\.\d+, sum by \(le\) \(rate\(([a-z0-9_:]+)\[", expr)
        assert series.endswith("_bucket"), expr


def test_dashboard_structure(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "kvfleet"
    (var,) = dashboard["templating"]["list"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["refId"]
