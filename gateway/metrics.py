"""The gateway's Prometheus metrics (its own registry): HTTP requests by endpoint and status, latency and
time to first token as the client sees them, routing decisions by policy and worker, 429s; and, from the
fleet snapshot the /metrics handler reads at scrape time (`refresh`), the fleet: request-stream length /
pending / lag and each live worker's free and total KV blocks.

Names differ from the workers' (kvfleet_http_*, kvfleet_gateway_*, kvfleet_fleet_*) so that sums over all
scraped targets never count a request or a block twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.fleet_state import FleetSnapshot, lag

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)


class _FleetCollector(Collector):
    """The last fleet snapshot (shared.streams.afleet_snapshot) as gauges."""

    def __init__(self) -> None:
        self.snapshot: FleetSnapshot | None = None

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot
        if snap is None:
            return
        length = GaugeMetricFamily("kvfleet_stream_length", "Entries in a request stream (queued + in work).",
                                   labels=["stream"])
        pending = GaugeMetricFamily("kvfleet_stream_pending", "Entries delivered to a worker, not yet acked.",
                                    labels=["stream"])
        lags = GaugeMetricFamily("kvfleet_stream_lag", "Entries no worker has taken yet (length - pending).",
                                 labels=["stream"])
        for name, info in snap["streams"].items():
            length.add_metric([name], info["length"])
            pending.add_metric([name], info["pending"])
            lags.add_metric([name], lag(info))
        yield from (length, pending, lags)
        free = GaugeMetricFamily("kvfleet_fleet_free_blocks", "A live worker's free KV blocks (its status).",
                                 labels=["worker", "model_name"])
        total = GaugeMetricFamily("kvfleet_fleet_total_blocks", "A live worker's KV blocks (its status).",
                                  labels=["worker", "model_name"])
        for w in snap["workers"]:
            free.add_metric([w["worker_id"], w["model"]], w["free_blocks"])
            total.add_metric([w["worker_id"], w["model"]], w["total_blocks"])
        yield from (free, total)
        live = GaugeMetricFamily("kvfleet_fleet_workers", "Workers by state.", labels=["state"])
        live.add_metric(["live"], len(snap["workers"]))
        live.add_metric(["dead"], len(snap["dead_workers"]))
        live.add_metric(["unreadable"], len(snap.get("unreadable_workers") or {}))
        yield live
        dead = GaugeMetricFamily("kvfleet_dead_letter_stream_length", "Entries in the dead-letter stream.")
        dead.add_metric([], snap["dead_letters"])
        yield dead


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=r)
        self.requests = Counter("kvfleet_http_requests_total", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("kvfleet_gateway_request_latency_seconds",
                                 "HTTP request to the last byte of the response, by endpoint.", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvfleet_gateway_time_to_first_token_seconds",
                              "Request arrival to the first output token relayed, by model.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.routing = Counter("kvfleet_routing_decisions_total",
                               "Requests placed, by routing policy and worker (\"any\": the shared stream).",
                               ["policy", "worker"], registry=r)
        self.rejected = Counter("kvfleet_rejected_total", "Requests answered 429 (fleet full).", registry=r)
        self.replaced = Counter("kvfleet_requests_placed_again_total",
                                "Requests Redis lost (restart without its data, flush) placed again by their relay.",
                                registry=r)
        self._fleet = _FleetCollector()
        r.register(self._fleet)
        # the labelled series in use: (policy, worker) of `routing` (pruned in refresh), of the HTTP ones, of `ttft`
        self._routed: dict[tuple[str, str], Any] = {}
        self._http: dict[tuple[str, int], tuple[Any, Any]] = {}
        self._ttft: dict[str, Any] = {}

    def observe_http(self, endpoint: str, status: int, seconds: float) -> None:
        series = self._http.get((endpoint, status))
        if series is None:  # labels() checks and locks on every call: the children are kept here
            series = self._http[endpoint, status] = (self.requests.labels(endpoint, str(status)),
                                                     self.latency.labels(endpoint))
        series[0].inc()
        series[1].observe(seconds)
        if status == 429:
            self.rejected.inc()

    def observe_ttft(self, model: str, seconds: float) -> None:
        series = self._ttft.get(model)
        if series is None:
            series = self._ttft[model] = self.ttft.labels(model)
        series.observe(seconds)

    def routed(self, policy: str, worker_id: str | None) -> None:
        key = (policy, worker_id or "any")
        series = self._routed.get(key)
        if series is None:
            series = self._routed[key] = self.routing.labels(*key)
        series.inc()

    def refresh(self, snapshot: FleetSnapshot | None) -> None:
        """The fleet as read for this scrape; None (Redis could not be read) leaves the fleet gauges out.
        A worker gone from the fleet (neither live nor dead: deregistered, e.g. a pod replaced under a new id)
        loses its routing series, so labels do not pile up over the gateway's life."""
        self._fleet.snapshot = snapshot
        if snapshot is None:
            return
        known = {w["worker_id"] for w in snapshot["workers"]} | set(snapshot["dead_workers"]) | {"any"}
        for policy, worker in [pw for pw in self._routed if pw[1] not in known]:
            self.routing.remove(policy, worker)
            del self._routed[policy, worker]
