"""services.bench.report: `kvfleet bench throughput`'s summary carries the CPU identity and kvfleet's paths, in the
JSON and in the table's header, with the ratios against the baselines."""

import argparse

import pytest

from services.bench.report import format_table, summarize
from services.bench.sampling import sampling_args
from services.bench.workload import Workload

pytestmark = pytest.mark.unit


def _result(tok_s: float, **extra) -> dict:
    return {"system": "x", "output_tok_per_s": tok_s, "total_tok_per_s": 3 * tok_s, "wall_s": 10.0,
            "peak_rss_bytes": 2**30, "achieved_flops": 1e11, "model_flops": 1e12, **extra}


def test_summary_names_cpu_and_paths():
    paths = {"linear": "oneDNN packed for any number of rows", "decode attention": "native avx2"}
    ours = _result(150.0, max_num_seqs=256, max_num_batched_tokens=2048, paths=paths, num_kv_blocks=100,
                   kv_peak_used_blocks=10, block_size=16, preemptions=0, kv_waste=0.02, kv_peak_waste=0.03,
                   kv_waste_samples=5, tensor_parallel_size=1)
    workload = Workload(name="w", path="w.json", requests=[])
    s = summarize(workload, argparse.Namespace(dtype="float32", threads=2), {"kvfleet": ours, "vllm": _result(
        100.0, vllm="0.32.0", max_num_seqs=256, threads_bind="auto")}, None)
    assert s["paths"] == paths and s["cpu"]["flags"] and "model" in s["cpu"]
    assert s["ratios"]["kvfleet/vllm"]["output_tok_per_s"] == pytest.approx(1.5)
    table = format_table(s)
    assert "CPU: " in table and "kvfleet linear: oneDNN packed for any number of rows" in table
    assert "kvfleet / vLLM CPU: 1.50x output tok/s" in table
    assert "2 threads, greedy" in table and s["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


def test_the_compute_line_sets_the_engine_against_the_probe_and_the_cores_peak():
    from services.bench.matmul_probe import ProbeResult

    ours = _result(150.0, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=100, kv_peak_used_blocks=10,
                   block_size=16, preemptions=0, kv_waste=0.02, kv_peak_waste=0.03, kv_waste_samples=5,
                   achieved_flops=6e11)
    probe = ProbeResult(dtype="bfloat16", best_flops=9e11, best_path="onednn-packed", best_tokens=1024,
                        peak_flops=1.2e12, peak_instruction="vdpbf16ps")
    workload = Workload(name="w", path="w.json", requests=[])
    s = summarize(workload, argparse.Namespace(dtype="bfloat16", threads=2), {"kvfleet": ours}, probe)
    assert s["flops"]["fraction_of_best"] == pytest.approx(2 / 3) and s["flops"]["probe"]["peak_flops"] == 1.2e12
    table = format_table(s)
    assert "= 67% of the best matmul here, 900.0 GFLOP/s" in table
    assert ("the cores' multiply-add peak right after: 1200.0 GFLOP/s (2 threads, vdpbf16ps in registers), "
            "the best matmul 75% of it, kvfleet 50%") in table


def test_sampled_runs_name_their_parameters_and_bad_ones_name_the_flag():
    ours = _result(150.0, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=100, kv_peak_used_blocks=10,
                   block_size=16, preemptions=0, kv_waste=0.02, kv_peak_waste=0.03, kv_waste_samples=5)
    args = argparse.Namespace(dtype="float32", threads=2, temperature=0.8, top_p=0.95, top_k=0)
    s = summarize(Workload(name="w", path="w.json", requests=[]), args, {"kvfleet": ours}, None)
    assert s["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 0}
    assert "sampled: temperature 0.8, top_p 0.95" in format_table(s)
    with pytest.raises(ValueError, match=r"^--top-p must be in"):
        sampling_args(argparse.Namespace(temperature=1.0, top_p=1.5, top_k=0))
    with pytest.raises(ValueError, match=r"^--top-k must be"):
        sampling_args(argparse.Namespace(temperature=1.0, top_p=1.0, top_k=-3))


def test_interleaved_rounds_give_the_median_of_the_rounds_ratios_and_list_every_round():
    ours = _result(120.0, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=100, kv_peak_used_blocks=10,
                   block_size=16, preemptions=0, kv_waste=0.02, kv_peak_waste=0.03, kv_waste_samples=5)
    rows = [{"round": i + 1, "order": order, "kvfleet": k, "vllm": v, "ratio": k / v,
             "vllm_cpu_s_while_kvfleet_ran": 0.1, "kvfleet_cpu_s_while_vllm_ran": 0.02}
            for i, (order, k, v) in enumerate([(["kvfleet", "vllm"], 120.0, 100.0), (["vllm", "kvfleet"], 110.0, 110.0),
                                               (["kvfleet", "vllm"], 130.0, 100.0)])]
    inter = {"rounds": rows, "ratio_median": 1.2, "ratio_min": 1.0, "ratio_max": 1.3}
    # the medians of each system (120 / 100) would say 1.2 too; the rounds' ratio is what the table reports
    s = summarize(Workload(name="w", path="w.json", requests=[]), argparse.Namespace(dtype="float32", threads=2),
                  {"kvfleet": ours, "vllm": _result(105.0, vllm="0.32.0", max_num_seqs=256, threads_bind="0-1")},
                  None, inter)
    assert s["ratios"]["kvfleet/vllm"]["output_tok_per_s"] == 1.2
    assert s["interleaved"] is inter
    table = format_table(s)
    assert "kvfleet / vLLM CPU: 1.20x output tok/s" in table
    assert "3 rounds each, alternating" in table and "1.00-1.30x" in table
    assert "round 2 (vllm then kvfleet): kvfleet 110.0, vLLM 110.0 output tok/s, 1.00x" in table


def test_with_rounds_the_share_of_the_best_matmul_is_the_median_of_each_rounds_against_its_own_reading():
    from services.bench.matmul_probe import ProbeResult

    ours = _result(120.0, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=100, kv_peak_used_blocks=10,
                   block_size=16, preemptions=0, kv_waste=0.02, kv_peak_waste=0.03, kv_waste_samples=5,
                   achieved_flops=3e11)
    # the probe after the rounds read 5e11 (ours: 60% of it); the readings right after each round differ
    probe = ProbeResult(dtype="float32", best_flops=5e11, best_path="onednn-packed", best_tokens=1024)
    rows = [{"round": i + 1, "order": ["kvfleet", "vllm"], "kvfleet": 120.0, "vllm": 100.0, "ratio": 1.2,
             "vllm_cpu_s_while_kvfleet_ran": 0.0, "kvfleet_cpu_s_while_vllm_ran": 0.0, "best_matmul_flops": best,
             "best_matmul_case": "onednn-packed@1024", "fraction_of_best": achieved / best}
            for i, (achieved, best) in enumerate([(3.0e11, 4.0e11), (3.1e11, 4.4e11), (2.9e11, 4.5e11)])]
    fractions = sorted(r["fraction_of_best"] for r in rows)
    inter = {"rounds": rows, "ratio_median": 1.2, "ratio_min": 1.2, "ratio_max": 1.2,
             "fraction_of_best_median": fractions[1], "fraction_of_best_min": fractions[0],
             "fraction_of_best_max": fractions[2]}
    s = summarize(Workload(name="w", path="w.json", requests=[]), argparse.Namespace(dtype="float32", threads=2),
                  {"kvfleet": ours, "vllm": _result(100.0, vllm="0.32.0", max_num_seqs=256, threads_bind="0-1")},
                  probe, inter)
    assert s["flops"]["fraction_of_best"] == pytest.approx(3.1 / 4.4)  # not 3 / 5 against the probe before
    assert s["flops"]["best_matmul_flops"] == 5e11
    table = format_table(s)
    assert ("= 70% of the best matmul here (the median of the rounds', each round against the probe's layer cases "
            "timed right after it: 64-75%); the probe after the rounds: 500.0 GFLOP/s (onednn-packed, 1024 tokens") in table
    assert "kvfleet peak RSS: its first round, before the probes after each round" in table
    assert ("round 2 (kvfleet then vllm)" in table
            and "the best matmul right after: 440.0 GFLOP/s (onednn-packed@1024), kvfleet 70% of it" in table)
