"""The gateway's per-worker series go when the worker leaves the fleet: the fleet gauges are rebuilt from each
snapshot, and the routing counter drops a worker that is neither live nor dead (deregistered)."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics


def workers_in(g: GatewayMetrics) -> dict[str, set[str]]:
    text = generate_latest(g.registry).decode()
    found: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "worker" in s.labels:
                found.setdefault(s.name, set()).add(s.labels["worker"])
    return found


def snapshot(live: list[str], dead: list[str]) -> dict:
    return {"workers": [{"worker_id": w, "model": "tiny", "free_blocks": 1, "total_blocks": 2} for w in live],
            "dead_workers": dead, "streams": {}, "dead_letters": 0}


def test_a_gone_worker_loses_its_series_and_the_others_keep_theirs():
    g = GatewayMetrics()
    for w in ("pod-a", "pod-b", None):
        g.routed("free_blocks", w)
    g.routed("prefix", "pod-b")
    g.refresh(snapshot(["pod-a", "pod-b"], []))
    assert workers_in(g)["kvfleet_routing_decisions_total"] == {"pod-a", "pod-b", "any"}
    g.refresh(snapshot(["pod-a"], ["pod-b"]))  # dead, not yet gone: its requests may still be taken over
    assert workers_in(g)["kvfleet_routing_decisions_total"] == {"pod-a", "pod-b", "any"}
    assert workers_in(g)["kvfleet_fleet_free_blocks"] == {"pod-a"}
    g.refresh(snapshot(["pod-a", "pod-c"], []))
    found = workers_in(g)
    assert found["kvfleet_routing_decisions_total"] == {"pod-a", "any"}
    assert found["kvfleet_fleet_free_blocks"] == {"pod-a", "pod-c"}
    g.refresh(None)  # Redis unreadable: nothing is pruned on a guess
    g.routed("free_blocks", "pod-b")  # it came back under its id: counted from zero again
    assert workers_in(g)["kvfleet_routing_decisions_total"] == {"pod-a", "pod-b", "any"}
