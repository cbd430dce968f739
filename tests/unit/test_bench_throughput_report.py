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
