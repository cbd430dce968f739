"""The result of `kvfleet bench throughput`: one summary dict (--json) and the table printed from it."""

from __future__ import annotations

import argparse
import dataclasses

from services.bench.sampling import describe_sampling, sampling_args
from services.bench.workload import Workload

LABELS = {"kvfleet": "kvfleet", "hf": "HF generate", "vllm": "vLLM CPU"}


def summarize(workload: Workload, args: argparse.Namespace, results: dict[str, dict], probe,
              interleaved: dict | None = None) -> dict:
    """results: system key ("kvfleet", "hf", "vllm") -> what its runner returned; probe: ProbeResult|None;
    interleaved: the rounds of --rounds (services.bench.interleave), whose median ratio is kvfleet/vllm's."""
    ours = results["kvfleet"]
    ratios = {}
    for key, res in results.items():
        if key != "kvfleet":
            ratios[f"kvfleet/{key}"] = {
                "output_tok_per_s": ours["output_tok_per_s"] / res["output_tok_per_s"],
                "total_tok_per_s": ours["total_tok_per_s"] / res["total_tok_per_s"],
            }
    if interleaved is not None:
        ratios["kvfleet/vllm"]["output_tok_per_s"] = interleaved["ratio_median"]  # paired rounds, not medians
    flops = {"achieved_flops": ours["achieved_flops"], "model_flops": ours["model_flops"]}
    if probe is not None:
        flops.update(best_matmul_flops=probe.best_flops, best_matmul_path=probe.best_path,
                     best_matmul_tokens=probe.best_tokens,
                     fraction_of_best=ours["achieved_flops"] / probe.best_flops, probe=dataclasses.asdict(probe))
        if interleaved is not None and "fraction_of_best_median" in interleaved:
            # each round against the probe's layer cases timed right after it: the median, as the vLLM ratio is
            flops.update(fraction_of_best=interleaved["fraction_of_best_median"],
                         fraction_of_best_min=interleaved["fraction_of_best_min"],
                         fraction_of_best_max=interleaved["fraction_of_best_max"])
    from services.bench.cpu import cpu_info

    return {
        "cpu": cpu_info(), "paths": ours.get("paths", {}),
        "workload": {"name": workload.name, "path": str(workload.path), "num_requests": len(workload.requests),
                     "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens},
        "dtype": args.dtype, "threads": args.threads, "sampling": sampling_args(args), "results": results, "ratios": ratios, "flops": flops,
    } | ({"interleaved": interleaved} if interleaved is not None else {})


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_table(summary: dict) -> str:
    wl, results = summary["workload"], summary["results"]
    lines = [f"kvfleet bench throughput: {wl['name']}, {wl['num_requests']} requests, {wl['prompt_tokens']} "
             f"prompt + {wl['output_tokens']} output tokens, {summary['dtype']}, {summary['threads']} threads, "
             f"{describe_sampling(summary.get('sampling'))}"]
    if "cpu" in summary:
        from services.bench.cpu import describe

        lines.append(f"CPU: {describe(summary['cpu'])}")
    lines += [f"kvfleet {name}: {path}" for name, path in summary.get("paths", {}).items()]
    lines.append("")
    header = f"{'system':<12} {'output tok/s':>12} {'total tok/s':>12} {'wall s':>8} {'peak RSS':>10}  notes"
    lines += [header, "-" * len(header)]
    for key, res in results.items():
        if key == "kvfleet":
            notes = f"max_num_seqs {res['max_num_seqs']}, max_num_batched_tokens {res['max_num_batched_tokens']}"
            if res.get("tensor_parallel_size", 1) > 1:
                notes += f", tensor parallel {res['tensor_parallel_size']} ranks (RSS: all of them)"
        elif key == "hf":
            notes = res["system"].split("(", 1)[-1].rstrip(")")
        else:
            notes = (f"vLLM {res.get('vllm')}, max_num_seqs {res.get('max_num_seqs')}, "
                     f"threads bind {res.get('threads_bind')}")
        lines.append(f"{LABELS.get(key, key):<12} {res['output_tok_per_s']:>12.1f} {res['total_tok_per_s']:>12.1f} "
                     f"{res['wall_s']:>8.1f} {_gib(res['peak_rss_bytes']):>10}  {notes}")
    lines.append("")
    for name, r in summary["ratios"].items():
        other = LABELS.get(name.split("/")[1], name)
        lines.append(f"kvfleet / {other}: {r['output_tok_per_s']:.2f}x output tok/s, "
                     f"{r['total_tok_per_s']:.2f}x total tok/s")
    if (inter := summary.get("interleaved")) is not None:
        probed = any("fraction_of_best" in r for r in inter["rounds"])
        rss = "; kvfleet peak RSS: its first round, before the probes after each round" if probed else ""
        lines.append(f"kvfleet and vLLM loaded side by side, {len(inter['rounds'])} rounds each, alternating "
                     f"(the rows above: each system's median round; the kvfleet / vLLM CPU output ratio: the median "
                     f"of the rounds' ratios, {inter['ratio_min']:.2f}-{inter['ratio_max']:.2f}x; vLLM stopped by SIGSTOP while "
                     f"kvfleet runs{rss}):")
        for r in inter["rounds"]:
            best = (f"; the best matmul right after: {r['best_matmul_flops'] / 1e9:.1f} GFLOP/s "
                    f"({r['best_matmul_case']}), kvfleet {100 * r['fraction_of_best']:.0f}% of it"
                    if "fraction_of_best" in r else "")
            lines.append(f"  round {r['round']} ({' then '.join(r['order'])}): kvfleet {r['kvfleet']:.1f}, vLLM "
                         f"{r['vllm']:.1f} output tok/s, {r['ratio']:.2f}x; the idle one's CPU meanwhile: vLLM "
                         f"{r['vllm_cpu_s_while_kvfleet_ran']:.2f} s, kvfleet {r['kvfleet_cpu_s_while_vllm_ran']:.2f} s"
                         f"{best}")
    ours = results["kvfleet"]
    if "profile" in ours:
        from services.bench.op_profile import format_profile

        lines.append(format_profile(ours["profile"]))
    lines.append(f"kvfleet KV cache: peak {ours['kv_peak_used_blocks']} of {ours['num_kv_blocks']} blocks used "
                 f"(block size {ours['block_size']}); preemptions {ours['preemptions']}; KV waste "
                 f"{100 * ours['kv_waste']:.2f}% (allocated slots - stored tokens over allocated, averaged over "
                 f"{ours['kv_waste_samples']} steps; peak {100 * ours['kv_peak_waste']:.2f}%)")
    f = summary["flops"]
    text = (f"kvfleet compute: {f['achieved_flops'] / 1e9:.1f} GFLOP/s achieved ({f['model_flops'] / 1e12:.2f} "
            f"TFLOP in {ours['wall_s']:.1f} s)")
    if "best_matmul_flops" in f:
        text += f" = {100 * f['fraction_of_best']:.0f}% of the best matmul here"
        if "fraction_of_best_min" in f:
            text += (f" (the median of the rounds', each round against the probe's layer cases timed right after it: "
                     f"{100 * f['fraction_of_best_min']:.0f}-{100 * f['fraction_of_best_max']:.0f}%); the probe after "
                     "the rounds:")
        else:
            text += ","
        text += (f" {f['best_matmul_flops'] / 1e9:.1f} GFLOP/s ({f['best_matmul_path']}, {f['best_matmul_tokens']} "
                 f"tokens x one layer's matmuls, {summary['dtype']})")
        for key, value in f["probe"].get("streamed_flops", {}).items():
            path, rows = key.split("@")
            text += (f"; a decode step's linear layers can reach {value / 1e9:.1f} GFLOP/s ({path}, {rows} rows over "
                     f"every layer's own weights and the lm_head, read from memory)")
        if peak := f["probe"].get("peak_flops"):
            instruction = f["probe"].get("peak_instruction") or "multiply-adds"
            text += (f"; the cores' multiply-add peak right after: {peak / 1e9:.1f} GFLOP/s ({summary['threads']} "
                     f"threads, {instruction} in registers), the best matmul "
                     f"{100 * f['best_matmul_flops'] / peak:.0f}% of it, kvfleet {100 * f['achieved_flops'] / peak:.0f}%")
        if unavailable := f["probe"].get("unavailable"):
            text += "; not on this CPU: " + "; ".join(f"{k} ({v})" for k, v in unavailable.items())
    lines.append(text)
    return "\n".join(lines)
