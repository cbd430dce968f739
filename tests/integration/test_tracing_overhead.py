"""The cost of tracing, measured in one run: two identical fleets (a worker on the tiny model + a gateway),
one exporting every span over OTLP/HTTP to a receiver, one with no endpoint; the same workload alternates
between them and the throughput of each is printed (`-s` to see it). The figure is printed, not asserted
(shared cores are noisy); the test asserts that every request was traced, with its 7 spans:

    .venv/bin/python -m pytest tests/integration/test_tracing_overhead.py -m slow -s
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fleet_harness import Fleet
from otlp_receiver import OtlpReceiver

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = 5
REQUESTS = 24  # per round
CONCURRENCY = 8
MAX_TOKENS = 16


def run_round(fleet: Fleet) -> tuple[float, float]:
    """(requests/s, output tokens/s) of REQUESTS requests, CONCURRENCY at a time."""
    client = fleet.client(timeout=300)
    model = os.path.basename(fleet.model)

    def one(i: int) -> int:
        out = client.completions.create(model=model, prompt=f"Request {i % 5}: write about the sea", temperature=0,
                                        max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        tokens = sum(pool.map(one, range(REQUESTS)))
    took = time.perf_counter() - start
    return REQUESTS / took, tokens / took


def test_tracing_overhead(tiny_llama_dir, tmp_path):
    with OtlpReceiver() as rx:
        traced_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint}
        with Fleet(tiny_llama_dir, tmp_path / "traced", env=traced_env) as traced, \
                Fleet(tiny_llama_dir, tmp_path / "plain") as plain:
            for f in (traced, plain):
                f.start_worker("w0", "--num-kv-blocks", "256", "--max-num-seqs", str(CONCURRENCY))
                f.start_gateway()
            for f in (traced, plain):
                f.wait_ready(workers=1)
                run_round(f)  # warm-up: tokenizer, first compiles, connections
            results: dict[str, list[tuple[float, float]]] = {"traced": [], "plain": []}
            for _ in range(ROUNDS):
                results["plain"].append(run_round(plain))
                results["traced"].append(run_round(traced))
        # both fleets stopped: their processes flushed what they had buffered
        requests = (ROUNDS + 1) * REQUESTS
        spans = rx.wait_for(lambda s: sum(x.name == "kvfleet.decode" for x in s) >= requests, timeout_s=30)
        traces = {x.trace_id for x in spans if x.name == "POST /v1/completions"}
        spans_per_request = sum(x.trace_id in traces for x in spans) / len(traces)
    med = {k: (statistics.median(r for r, _ in v), statistics.median(t for _, t in v)) for k, v in results.items()}
    overhead = 1 - med["traced"][1] / med["plain"][1]
    print(f"\ntracing overhead ({ROUNDS} alternating rounds of {REQUESTS} requests x {MAX_TOKENS} tokens, "
          f"{CONCURRENCY} concurrent, tiny model on CPU; medians):")
    for k in ("plain", "traced"):
        rounds = ", ".join(f"{r:.2f}" for r, _ in results[k])
        print(f"  {k:<7} {med[k][0]:6.2f} req/s  {med[k][1]:7.1f} tok/s   (req/s per round: {rounds})")
    print(f"  throughput cost of tracing: {overhead * 100:+.1f}%  ({spans_per_request:.1f} spans per request)")
    assert len(traces) == requests
    assert spans_per_request == 7  # gateway server, route, enqueue; worker request, queue wait, prefill, decode
