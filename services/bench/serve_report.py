"""The result of `kvfleet bench serve`: each run summed up as a dict (the JSON report), the table printed from
the report, the plots (latency against rate, TTFT distribution) and the CPU it ran on."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

from services.bench.cpu import describe
from services.bench.load_gen import LoadRun
from services.bench.plots import CdfChart, LineChart, Series, write_html
from services.bench.sampling import describe_sampling
from services.bench.serve_redis import describe as describe_redis
from services.bench.stats import SLO, Summary, goodput

LABELS = {"kvfleet": "kvfleet", "vllm": "vLLM"}
METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))


def _summary(values: list[float]) -> dict[str, float] | None:
    s = Summary.of(values)
    return dataclasses.asdict(s) if s is not None else None


def summarize_run(run: LoadRun, *, rate: float, concurrency: int | None, slo: SLO,
                  fleet: dict[str, Any] | None) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    d = run.duration_s
    outcomes = [(r.ttft_s, r.tpot_s, r.e2e_s) for r in ok]
    return {
        "request_rate": None if rate == float("inf") else rate,  # None: all requests at once
        "concurrency": concurrency, "num_requests": len(run.results), "completed": len(ok),
        "failed": len(run.results) - len(ok), "errors": dict(Counter(r.error for r in run.results if not r.ok)),
        "duration_s": d, "client_cpu_s": run.client_cpu_s, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": len(ok) / d, "output_tok_per_s": out_tokens / d,
        "total_tok_per_s": (in_tokens + out_tokens) / d,
        "goodput_req_per_s": goodput(outcomes, slo, d), "slo_met": sum(1 for o in outcomes if slo.met(*o)),
        "ttft_s": _summary([r.ttft_s for r in ok]), "tpot_s": _summary([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": _summary([x for r in ok for x in r.itl_s]), "e2e_s": _summary([r.e2e_s for r in ok]),
        "ttft_samples_s": [round(r.ttft_s, 6) for r in ok], "fleet": fleet,
    }


def ratios(ours: list[dict], peer: list[dict]) -> list[dict[str, Any]]:
    """kvfleet / peer at each load point: > 1 is better for throughput, < 1 better for latency."""
    out = []
    for a, b in zip(ours, peer, strict=False):
        row: dict[str, Any] = {"request_rate": a["request_rate"], "concurrency": a["concurrency"]}
        for key in ("request_throughput", "output_tok_per_s", "total_tok_per_s", "goodput_req_per_s"):
            row[key] = a[key] / b[key] if b[key] else None
        for key, _ in METRICS:
            if a[key] and b[key]:
                row[f"{key}_p50"] = a[key]["p50"] / b[key]["p50"] if b[key]["p50"] else None
        out.append(row)
    return out


def _load_text(run: dict) -> str:
    rate = "all at once" if run["request_rate"] is None else f"Poisson {run['request_rate']:g} req/s"
    cap = f", at most {run['concurrency']} in flight" if run["concurrency"] else ""
    return f"{run['num_requests']} requests, {rate}{cap}"


def _rows(run: dict) -> list[tuple[str, str]]:
    rows = [("requests ok / failed", f"{run['completed']} / {run['failed']}"),
            ("duration s", f"{run['duration_s']:.2f}"),
            ("load generator CPU s", f"{run['client_cpu_s']:.2f}"),
            ("request throughput req/s", f"{run['request_throughput']:.2f}"),
            ("output tokens/s", f"{run['output_tok_per_s']:.1f}"),
            ("total tokens/s", f"{run['total_tok_per_s']:.1f}"),
            ("goodput req/s (meeting the SLO)", f"{run['goodput_req_per_s']:.2f}")]
    for key, name in METRICS:
        s = run[key]
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{name} {stat} ms", f"{1000 * s[stat]:.1f}" if s else "-"))
    return rows


def format_table(report: dict[str, Any]) -> str:
    cpu, wl, systems = report["cpu"], report["workload"], report["systems"]
    lines = [f"kvfleet bench serve: {wl['name']} ({wl['num_requests']} requests, {wl['prompt_tokens']} prompt + "
             f"{wl['output_tokens']} output tokens, {describe_sampling(report.get('sampling'))})",
             f"CPU: {describe(cpu)}, {cpu['cores']} logical cores; load average "
             f"{cpu['load_average_1m']:g} at the start",
             f"SLO for goodput: {report['slo']['text']}"]
    for key, sys_ in systems.items():
        where = f"failed: {sys_['error']}" if sys_.get("error") else f"{sys_['endpoint']} {sys_['config']}"
        lines.append(f"{LABELS.get(key, key)}: {where}")
    keys = list(systems)
    peer = keys[1] if len(keys) > 1 else None
    for i, ours in enumerate(systems[keys[0]]["runs"]):
        runs = [systems[k]["runs"][i] if i < len(systems[k]["runs"]) else None for k in keys]
        cols = [LABELS.get(k, k) for k in keys] + ([f"{LABELS[keys[0]]}/{LABELS.get(peer, peer)}"] if peer else [])
        lines += ["", f"load: {_load_text(ours)}", f"{'metric':<34}" + "".join(f"{c:>16}" for c in cols)]
        lines.append("-" * (34 + 16 * len(cols)))
        per_sys = [_rows(r) if r else [] for r in runs]
        for j, (name, _) in enumerate(per_sys[0]):
            cells = [rows[j][1] if rows else "-" for rows in per_sys]
            if peer and runs[1] is not None:
                a, b = _num(cells[0]), _num(cells[1])
                cells.append(f"{a / b:.2f}x" if a is not None and b else "")
            lines.append(f"{name:<34}" + "".join(f"{c:>16}" for c in cells))
        for k, r in zip(keys, runs, strict=True):
            for error, count in (r or {}).get("errors", {}).items():
                lines.append(f"  {LABELS.get(k, k)} failed {count}x: {error}")
            if r and r.get("fleet"):
                f = r["fleet"]
                per = ", ".join(f"{w} {v['requests']} req / {v['generation_tokens']} tok / {v['preemptions']} preempted"
                                for w, v in f["workers"].items())
                peaks = (f"peak queue lag {f['max_queue_lag']}, peak waiting {f['max_waiting']}"
                         if f.get("max_queue_lag") is not None else "peaks not sampled (--redis-stats)")
                lines.append(f"  {LABELS.get(k, k)} fleet: {per}; {peaks}")
            if r and r.get("redis"):
                lines.append(f"  {LABELS.get(k, k)} Redis: {describe_redis(r['redis'])}")
    if report.get("plot"):
        lines += ["", f"plots: {report['plot']}"]
    return "\n".join(lines)


def _num(cell: str) -> float | None:
    try:
        return float(cell.split(" /")[0])
    except ValueError:
        return None


def write_plots(report: dict[str, Any], path: Path) -> Path:
    systems = report["systems"]
    charts: list[LineChart | CdfChart] = []
    swept = [k for k, s in systems.items() if sum(r["request_rate"] is not None for r in s["runs"]) > 1]
    for key, name, log_y in (("ttft_s", "TTFT", True), ("tpot_s", "TPOT", False), ("e2e_s", "E2E latency", True)):
        series = []
        for k in swept:
            runs = [r for r in systems[k]["runs"] if r["request_rate"] is not None and r[key]]
            for stat in ("p50", "p99"):
                series.append(Series(f"{LABELS.get(k, k)} {stat}", [r["request_rate"] for r in runs],
                                     [r[key][stat] for r in runs]))
        if series:
            charts.append(LineChart(f"{name} against request rate", "offered request rate (req/s)", "seconds",
                                    series, log_y=log_y))
    if swept:
        charts.append(LineChart("Output throughput against request rate", "offered request rate (req/s)",
                                "output tokens/s", [Series(LABELS.get(k, k), [r["request_rate"] for r in systems[k]["runs"]],
                                                           [r["output_tok_per_s"] for r in systems[k]["runs"]])
                                                    for k in swept]))
    samples = {}
    for k, s in systems.items():
        for r in s["runs"]:
            at = "" if len(s["runs"]) == 1 else f" @ {r['request_rate']:g} req/s" if r["request_rate"] else " @ all at once"
            samples[f"{LABELS.get(k, k)}{at}"] = r["ttft_samples_s"]
    charts.append(CdfChart("TTFT distribution", "time to first token (s)", samples))
    cpu, wl = report["cpu"], report["workload"]
    notes = [f"{wl['name']}: {wl['num_requests']} requests; CPU {cpu['model']} ({cpu['cores']} logical cores)",
             f"SLO: {report['slo']['text']}"]
    return write_html(path, "kvfleet bench serve", charts, notes)
