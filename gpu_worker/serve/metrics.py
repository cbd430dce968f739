"""A worker's Prometheus metrics, under vLLM's names where vLLM has one (so its dashboards and autoscalers
work), plus the KV-block gauges and Redis delivery counters vLLM lacks. Labels: model_name, worker.

Two sources, both cheap for the step loop:
  - scheduler state (running, waiting, blocks, preemptions, prefix-cache counters) is read at scrape time
    from the last SchedulerStats snapshot the worker keeps (`stats()`), never pushed per step;
  - per-request histograms and token counters are observed once per request (first token, finish), and
    generated tokens are added per output as a plain int (read at scrape time).

`recent()` summarizes the last requests (TTFT percentiles, tokens generated) for the worker's status,
which `kvfleet top` shows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ("model_name", "worker")

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

RECENT_WINDOW = 256  # requests the TTFT percentiles of the status are taken over
TOKENS_REFRESH_S = 0.5


class _SchedulerCollector(Collector):
    """Gauges and totals straight from the scheduler's last stats snapshot, at scrape time."""

    def __init__(self, metrics: WorkerMetrics):
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        m, labels = self.m, [self.m.model_name, self.m.worker_id]
        gen = CounterMetricFamily("vllm:generation_tokens", "Generated tokens sent to clients.", labels=LABELS)
        gen.add_metric(labels, m.generation_tokens)
        yield gen
        stats = m.stats()
        if stats is None:
            return
        total = max(1, stats.total_blocks)
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = no free block).", stats.used_blocks / total),
            ("kvfleet_kv_free_blocks", "Free KV-cache blocks (incl. evictable prefix-cached ones).",
             stats.free_blocks),
            ("kvfleet_kv_total_blocks", "KV-cache blocks in all.", stats.total_blocks),
            ("kvfleet_kv_cached_blocks", "Blocks registered in the prefix cache.", stats.cached_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            yield g
        for name, doc, value in (
            ("vllm:num_preemptions", "Preemptions (by recompute) since start.", stats.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            yield c


class WorkerMetrics:
    """`stats()` returns the worker's latest SchedulerStats (or None before the first)."""

    def __init__(self, model_name: str, worker_id: str, stats: Callable[[], Any],
                 registry: CollectorRegistry | None = None):
        self.model_name, self.worker_id, self.stats = model_name, worker_id, stats
        self.registry = registry if registry is not None else CollectorRegistry()
        self.generation_tokens = 0  # added by the main thread per output; read at scrape time
        r, lv = self.registry, (model_name, worker_id)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=r).labels(*lv)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Gateway arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Per request: mean time between output tokens (decode time / (tokens - 1)).", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Gateway arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Gateway arrival to first scheduled (Redis + "
                          "scheduler queue).", REQUEST_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Prompt tokens prefilled.")
        self.success = Counter("vllm:request_success_total", "Finished requests by finish reason.",
                               LABELS + ("finished_reason",), registry=r)
        self.redeliveries = counter("kvfleet_redeliveries_total",
                                    "Requests taken over from a dead worker or delivered again.")
        self.dead_letters = counter("kvfleet_dead_letters_total", "Requests sent to the dead-letter stream.")
        r.register(_SchedulerCollector(self))
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=RECENT_WINDOW)  # TTFTs of the last requests
        self._summary: dict[str, float] = {}
        self._tokens_shown, self._tokens_at = 0, 0.0

    # ---- per request (main thread) ---------------------------------------------------------------------
    def first_token(self, prompt_tokens: int, ttft_s: float | None) -> None:
        """A request's first token here (after a takeover: the first after the recompute)."""
        self.prompt_tokens.inc(prompt_tokens)
        if ttft_s is not None and ttft_s >= 0:
            self.ttft.observe(ttft_s)
            with self._lock:
                self._recent.append(ttft_s)
                self._summary = _percentiles(self._recent)

    def finished(self, metrics: Any, output_tokens: int, finish_reasons: list[str]) -> None:
        """`metrics`: the engine's RequestMetrics (monotonic times, arrival = the gateway's arrival)."""
        if metrics is not None and metrics.finished_time is not None:
            self.e2e.observe(max(0.0, metrics.finished_time - metrics.arrival_time))
            if metrics.first_scheduled_time is not None:
                self.queue.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
            if metrics.first_token_time is not None and output_tokens > 1:
                self.itl.observe(max(0.0, metrics.finished_time - metrics.first_token_time) / (output_tokens - 1))
        for reason in finish_reasons or ["abort"]:
            self.success.labels(self.model_name, self.worker_id, reason).inc()

    def recent(self) -> dict[str, Any]:
        """For the worker's status: TTFT p50/p95/p99 over the last requests, and the tokens generated so far,
        refreshed at most every TOKENS_REFRESH_S (so the status does not change, and go out, every step)."""
        now = time.monotonic()
        if now - self._tokens_at >= TOKENS_REFRESH_S:
            self._tokens_shown, self._tokens_at = self.generation_tokens, now
        with self._lock:
            return dict(self._summary, generation_tokens=self._tokens_shown)


def _percentiles(values: deque[float]) -> dict[str, float]:
    s = sorted(values)
    return {f"ttft_p{q}_s": round(s[min(len(s) - 1, int(q / 100 * len(s)))], 6) for q in (50, 95, 99)}
