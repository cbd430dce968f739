"""`kvfleet bench throughput --rounds N` (services.bench.interleave): kvfleet's loaded engine runs the workload
once per round from an empty prefix cache, alternating with vLLM's child over its stdin protocol (READY, then
`go` -> ROUND {json}, then RESULT at end of input). vLLM's part is played here by a stand-in child that speaks
the same protocol (the real one needs vLLM's venv); kvfleet's engine is real, on a tiny checkpoint."""

import argparse
import json
import os
import stat
import subprocess
import sys
import time

import pytest

from services.bench.engine import EngineBench
from services.bench.interleave import VllmRounds, run_interleaved
from services.bench.metrics import ModelShape, cpu_seconds
from services.bench.peers import PeerFailed
from services.bench.workload import BenchRequest, Workload

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

# What services.bench.peer_vllm --rounds N says, from a process that generates nothing: each round sleeps
# 0.3 s and reports 100 output tokens/s (+1 a round). Between rounds it spins, as an idle engine that polls would:
# unless it is stopped while kvfleet runs, its CPU time grows meanwhile.
STAND_IN = r'''
import json, sys, threading, time
rounds = int(sys.argv[sys.argv.index("--rounds") + 1])
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print("loading", flush=True)
print("READY", flush=True)
done = []
for line in sys.stdin:
    assert line.strip() == "go", line
    time.sleep(0.3)
    done.append({"wall_s": 0.3, "output_tokens": 30, "output_tok_per_s": 100.0 + len(done), "peak_rss_bytes": 1})
    print("ROUND " + json.dumps(done[-1]), flush=True)
assert len(done) == rounds, (len(done), rounds)
print("RESULT " + json.dumps({"output_tok_per_s": 101.0, "total_tok_per_s": 200.0, "wall_s": 0.3,
                              "peak_rss_bytes": 1, "rounds": done}), flush=True)
'''


def _workload() -> Workload:
    shared = list(range(100, 124))  # 24 tokens: 3 full blocks of 8 shared by the first two requests
    prompts = [shared + [5, 6, 7], shared + [9], list(range(400, 411))]
    return Workload(name="tiny", path="tiny.json",
                    requests=[BenchRequest(i, p, 5) for i, p in enumerate(prompts)])


def _args(tmp_path, rounds: int, max_num_seqs: int = 8) -> argparse.Namespace:
    return argparse.Namespace(dtype="float32", threads=1, block_size=8, num_kv_blocks=64, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=64, no_prefix_caching=False, temperature=0.0, top_p=1.0,
                              top_k=0, rounds=rounds, vllm_venv=tmp_path / "venv")


def _fake_venv(tmp_path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)


def test_every_round_starts_from_an_empty_prefix_cache(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    shape = ModelShape.from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    # one sequence at a time: the second request is admitted once the first's blocks are in the prefix cache
    bench = EngineBench(tiny_llama_dir, _workload(), shape, _args(tmp_path, 3, max_num_seqs=1), progress=False)
    try:
        rounds = [bench.round() for _ in range(3)]
    finally:
        bench.close()
    # the second request hits the first's 3 shared blocks within a round, and never a block of an earlier round
    # (which would be 24 + 24 + 8: every full block of the three prompts)
    assert [r["prefix_cache_hit_tokens"] for r in rounds] == [24, 24, 24]
    assert all(r["output_tokens"] == 15 and r["num_requests"] == 3 for r in rounds)
    assert rounds[0]["model_flops"] == rounds[2]["model_flops"]
    # warmed up as a worker is (gpu_worker.engine.warmup): a step of max_num_batched_tokens (64) prompt tokens among
    # others, before the first round; and none of its prompts' blocks was a hit in a round (the 24 above)
    assert bench.warmup.prompt_tokens >= 64 and bench.warmup.requests >= 3


def test_rounds_alternate_with_the_peer_and_the_ratio_is_the_median_of_the_rounds(tiny_llama_dir, tmp_path):
    from transformers import AutoConfig

    _fake_venv(tmp_path)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    requests_json = tmp_path / "requests.json"
    # kvfleet's rounds long enough for a spinning peer to show: ~0.6 s at the ~12,000 tokens/s the tiny model makes on
    # a Zen 5 (40 requests made 0.19 s there, under the 0.2 s the check below needs)
    workload = Workload(name="tiny x120", path="tiny.json",
                        requests=[BenchRequest(i, [1000 + i, *range(400, 420)], 60) for i in range(120)])
    requests_json.write_text(json.dumps(workload.to_peer_json(tiny_llama_dir)))
    ours, peer, inter = run_interleaved(tiny_llama_dir, workload, shape, requests_json, _args(tmp_path, 3),
                                        progress=False, probe=True)
    assert [r["order"] for r in inter["rounds"]] == [["kvfleet", "vllm"], ["vllm", "kvfleet"], ["kvfleet", "vllm"]]
    assert [r["vllm"] for r in inter["rounds"]] == [100.0, 101.0, 102.0]
    ratios = [r["kvfleet"] / r["vllm"] for r in inter["rounds"]]
    assert [r["ratio"] for r in inter["rounds"]] == pytest.approx(ratios)
    assert inter["ratio_median"] == pytest.approx(sorted(ratios)[1])
    assert (inter["ratio_min"], inter["ratio_max"]) == pytest.approx((min(ratios), max(ratios)))
    assert peer["rounds"] and len(peer["rounds"]) == 3
    kv = sorted(r["output_tok_per_s"] for r in ours["rounds"])
    assert len(kv) == 3 and ours["output_tok_per_s"] == kv[1]  # the median round's result
    # the probe's layer cases timed after each kvfleet round: each round's share of the best matmul then
    fractions = [r["fraction_of_best"] for r in inter["rounds"]]
    assert all(r["best_matmul_flops"] > 0 and "@" in r["best_matmul_case"] for r in inter["rounds"])
    assert inter["fraction_of_best_median"] == pytest.approx(sorted(fractions)[1])
    # the probes' weights stay in this process: the peak RSS reported is the first round's, taken before any
    assert ours["peak_rss_bytes"] == ours["rounds"][0]["peak_rss_bytes"] > 0
    # the stand-in spins between its rounds: stopped while kvfleet runs, it uses no CPU then
    assert min(r["wall_s"] for r in ours["rounds"]) > 0.2, "kvfleet's rounds are too short to tell"
    assert all(r["vllm_cpu_s_while_kvfleet_ran"] <= 0.02 for r in inter["rounds"])
    # and this process waits on the stand-in's pipe while it runs (which sleeps, but its spinner runs)
    assert all(r["kvfleet_cpu_s_while_vllm_ran"] < 0.2 for r in inter["rounds"])


def test_a_peer_that_dies_before_ready_is_reported_with_what_it_said(tmp_path):
    cmd = [sys.executable, "-c", "print('no vllm here', flush=True); raise SystemExit(3)"]
    with pytest.raises(PeerFailed, match=r"(?s)code 3\) before READY.*no vllm here"):
        VllmRounds(cmd, dict(os.environ), tmp_path / "vllm.log")


def test_cpu_seconds_counts_a_busy_process_tree_and_not_a_sleeping_one():
    busy = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                             "'import time\\nt = time.time()\\nwhile time.time() - t < 1.0: pass']); "
                             "import time; time.sleep(5)"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.3)  # both interpreters started
        b0, s0 = cpu_seconds(busy.pid, children=True), cpu_seconds(sleeper.pid, children=True)
        time.sleep(0.6)
        b1, s1 = cpu_seconds(busy.pid, children=True), cpu_seconds(sleeper.pid, children=True)
        assert b1 - b0 > 0.2  # the grandchild spins (on a busy 2-core machine it still gets a share)
        assert s1 - s0 < 0.05
        assert cpu_seconds(busy.pid) < b1  # without children: the parent alone, which only waits
    finally:
        for p in (busy, sleeper):
            p.kill()
            p.wait()
