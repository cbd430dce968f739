"""What the fleet simulator reports per policy: the percentiles `kvfleet bench serve` reports (TTFT, TPOT,
inter-token latency, end-to-end latency: mean, p50, p90, p99; output, total and request throughput), plus the
prefix-cache hit rate, preemptions, the requests that waited in the shared queue, and the simulator's own speed.
As JSON (one dict per policy), a table, and charts (services.bench.plots).
Percentiles are services.bench.stats.percentile's (numpy's linear interpolation, as `bench serve`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.bench import stats
from services.bench.fleet_sim import SimRun
from services.bench.plots import CdfChart, LineChart, Series, write_html

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """NaN for no values (a run whose every request made one token has no inter-token latency)."""
    return stats.percentile(values, q) if values else math.nan


def latencies(run: SimRun) -> dict[str, list[float]]:
    """Per request (ttft, tpot, e2e) and per token gap (itl), in seconds."""
    out: dict[str, list[float]] = {k: [] for k in LATENCIES}
    for t in run.traces:
        arrival, times = t.sent_s, t.token_times
        out["ttft"].append(times[0] - arrival)
        out["e2e"].append(t.finish_s - arrival)
        if len(times) > 1:
            out["tpot"].append((times[-1] - times[0]) / (len(times) - 1))
            out["itl"] += [b - a for a, b in itertools.pairwise(times)]
    return out


def summarize(run: SimRun) -> dict[str, Any]:
    lat = latencies(run)
    duration = max(max(t.finish_s for t in run.traces) - min(t.sent_s for t in run.traces), 1e-9)
    out_tokens = sum(len(t.token_times) for t in run.traces)
    prompt_tokens = sum(len(t.request.prompt) for t in run.traces)
    summary: dict[str, Any] = {
        "policy": run.policy, "requests": len(run.traces), "duration_s": round(duration, 3),
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "output_throughput": out_tokens / duration, "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "request_throughput": len(run.traces) / duration,
        "prefix_cache_hit_rate": run.prefix_hits / run.prefix_queries if run.prefix_queries else 0.0,
        "preemptions": run.preemptions, "routed_to_shared_queue": run.routed_to_shared,
        "sim_wall_s": round(run.wall_s, 3), "sim_cpu_s": round(run.cpu_s, 3), "sim_steps": run.steps, "sim_events": run.events,
    }
    per_worker = Counter(t.worker for t in run.traces)
    summary["preempted_requests"] = sum(1 for t in run.traces if t.preemptions)
    summary["busiest_worker_share"] = max(per_worker.values()) / len(run.traces)  # of all requests
    for kind in sorted({t.request.kind for t in run.traces}):
        ttft = [t.token_times[0] - t.sent_s for t in run.traces if t.request.kind == kind]
        summary[f"p90_ttft_s_{kind}"] = percentile(ttft, 90)
    for name, values in lat.items():
        summary[f"mean_{name}_s"] = sum(values) / len(values) if values else math.nan
        for q in PERCENTILES:
            summary[f"p{q}_{name}_s"] = percentile(values, q)
    return summary


def format_table(summaries: list[dict[str, Any]], header: str = "") -> str:
    """One column per policy; latencies in ms."""
    rows: list[tuple[str, list[str]]] = []
    for name in LATENCIES:
        for q in PERCENTILES:
            rows.append((f"{name.upper()} p{q} (ms)", [f"{s[f'p{q}_{name}_s'] * 1000:.1f}" for s in summaries]))
    rows += [
        ("output tokens/s", [f"{s['output_throughput']:.0f}" for s in summaries]),
        ("total tokens/s", [f"{s['total_token_throughput']:.0f}" for s in summaries]),
        ("requests/s", [f"{s['request_throughput']:.2f}" for s in summaries]),
        ("prefix-cache hit rate", [f"{s['prefix_cache_hit_rate']:.1%}" for s in summaries]),
        ("preemptions", [str(s["preemptions"]) for s in summaries]),
        ("busiest worker's requests", [f"{s['busiest_worker_share']:.1%}" for s in summaries]),
        ("via the shared queue", [str(s["routed_to_shared_queue"]) for s in summaries]),
        ("simulated seconds", [f"{s['duration_s']:.1f}" for s in summaries]),
        ("simulator wall s", [f"{s['sim_wall_s']:.2f}" for s in summaries]),
        ("simulator CPU s", [f"{s['sim_cpu_s']:.2f}" for s in summaries]),
    ]
    width = max(len(r[0]) for r in rows) + 2
    cols = [max(12, len(s["policy"]) + 2) for s in summaries]
    lines = [header] if header else []
    lines.append("".ljust(width) + "".join(s["policy"].rjust(c) for s, c in zip(summaries, cols, strict=True)))
    for label, cells in rows:
        lines.append(label.ljust(width) + "".join(v.rjust(c) for v, c in zip(cells, cols, strict=True)))
    return "\n".join(lines)


def write_plots(path: str | Path, title: str, runs: list[SimRun], notes: Sequence[str] = ()) -> Path:
    """TTFT and E2E distributions per policy, and the latency percentiles side by side."""
    lat = {r.policy: latencies(r) for r in runs}
    charts: list[LineChart | CdfChart] = [
        CdfChart("TTFT distribution", "seconds", {p: v["ttft"] for p, v in lat.items()}, log_x=True),
        CdfChart("End-to-end latency distribution", "seconds", {p: v["e2e"] for p, v in lat.items()}, log_x=True),
    ]
    for name in ("ttft", "itl"):
        charts.append(LineChart(f"{name.upper()} percentiles", "percentile", "seconds",
                                [Series(p, list(PERCENTILES), [max(percentile(v[name], q), 1e-6) for q in PERCENTILES])
                                 for p, v in lat.items()], log_y=True))
    return write_html(path, title, charts, notes)
