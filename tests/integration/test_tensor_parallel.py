"""Tensor parallelism on CPU (gloo): a worker split over 2 ranks gives Hugging Face's greedy tokens and logprobs
for every family, through preemption, chunked prefill and prefix caching; over 4 ranks (more ranks than the 2 KV
heads: replicated) too. A split that cannot be made is refused before any process starts. A rank that dies is an
EngineFault within a second, without a hang; and a worker whose rank dies exits, its requests are taken over,
and each client still gets the whole greedy text once."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
from fleet_harness import Fleet
from tiny_models import hf_greedy

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.llm_engine import EngineFault

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 10
SHARED = list(range(1000, 1013))  # 13 tokens: 3 full blocks of 4 shared between prompts
PROMPTS = [list(range(200, 205)), SHARED + [7, 8, 9], list(range(3000, 3031)), SHARED + [11], [42],
           SHARED + list(range(500, 510))]


def _generate(model_dir, tp: int):
    with LLM(str(model_dir), block_size=4, num_kv_blocks=22, max_num_batched_tokens=16, max_num_seqs=6,
             max_model_len=128, tensor_parallel_size=tp) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        return outs, llm.engine.stats()


def _assert_matches_hf(model_dir, outs):
    for (want_ids, want_lps), out in zip(hf_greedy(model_dir, PROMPTS, MAX_TOKENS), outs, strict=True):
        c = out.outputs[0]
        assert c.token_ids == want_ids
        got = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(got, want_lps, strict=True)) < 1e-3


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_two_ranks_match_hf(kind, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    outs, stats = _generate(model_dir, tp=2)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    _assert_matches_hf(model_dir, outs)
    assert not multiprocessing.active_children(), "the executor outlived LLM.close()"


def test_four_ranks_replicate_kv_heads(tiny_llama_dir):
    outs, _ = _generate(tiny_llama_dir, tp=4)  # 4 query heads, 2 KV heads: each KV head on 2 ranks
    _assert_matches_hf(tiny_llama_dir, outs)


def test_two_ranks_score_prompts_and_hold_grammars_as_one(tiny_llama_dir):
    """Prompt logprobs under tensor parallelism: each scored slice is a vocabulary gather every rank takes part in
    (the targets travel with the step). Greedy structured outputs too. Both equal one process's."""
    prompts = [{"prompt_token_ids": p} for p in (list(range(3000, 3031)), SHARED + [7, 8, 9], [42, 43])]
    scored = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    shaped = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[a-c]{2}-[0-9]{2}"})
    results = []
    for tp in (1, 2):
        with LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_model_len=128,
                 tensor_parallel_size=tp) as llm:
            results.append((llm.generate(prompts, scored, use_tqdm=False), llm.generate(prompts, shaped, use_tqdm=False)))
    (one_scored, one_shaped), (two_scored, two_shaped) = results
    for prompt, a, b in zip(prompts, one_scored, two_scored, strict=True):
        assert a.prompt_logprobs[0] is b.prompt_logprobs[0] is None and len(b.prompt_logprobs) == len(a.prompt_logprobs)
        for t, x, y, ra, rb in zip(prompt["prompt_token_ids"][1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:],
                                   a.prompt_logprob_ranks[1:], b.prompt_logprob_ranks[1:], strict=True):
            assert abs(x[t] - y[t]) < 1e-3 and abs(max(x.values()) - max(y.values())) < 1e-3
            assert abs(ra - rb) <= 2  # the same rank, up to float noise among near-equal logits
    assert [o.outputs[0].text for o in one_shaped] == [o.outputs[0].text for o in two_shaped]
    assert all(len(o.outputs[0].text) == 5 for o in two_shaped)


def test_split_refused_before_any_process(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, num_kv_blocks=8)
    assert not multiprocessing.active_children()
    with pytest.raises(ValueError, match="integer >= 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0, num_kv_blocks=8)


def test_dead_rank_is_an_engine_fault(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=32, max_model_len=128, tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    executor = llm.engine.runner.procs[0]
    os.kill(executor.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while llm.engine.fault() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.engine.fault() == f"rank 1 (pid {executor.pid}) exited with code -9"
    llm.engine.add_request("after", [5, 6, 7], params)
    started = time.monotonic()
    with pytest.raises(EngineFault, match="rank 1"):  # not bisected, not blamed on the request
        llm.engine.step()
    llm.close()
    assert time.monotonic() - started < 5
    assert not multiprocessing.active_children()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _executors(pid: int) -> list[int]:
    """The worker's executor processes (its multiprocessing resource tracker is not one)."""
    out = []
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(child)
    return out


@pytest.mark.slow
def test_worker_whose_rank_dies_exits_and_its_requests_are_taken_over(tiny_llama_dir, tmp_path):
    prompts = [f"Story {i}: once upon a time" for i in range(3)]
    max_tokens = 400
    with LLM(str(tiny_llama_dir), max_model_len=1024, num_kv_blocks=256) as llm:
        want = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)]

    env = {"KVFLEET_STATUS_TTL_S": "2", "KVFLEET_HEARTBEAT_S": "0.5"}
    with Fleet(tiny_llama_dir, tmp_path, env=env) as fleet:
        worker = fleet.start_worker("w0", "--tensor-parallel-size", "2", "--num-kv-blocks", "256", "--no-warmup")
        fleet.start_gateway()
        fleet.wait_ready(workers=1)
        executors = fleet.wait_for(lambda: _executors(worker.pid), what="w0's executor process")
        client = fleet.client(timeout=120)
        texts: list[list[str]] = [[] for _ in prompts]
        errors: list[BaseException] = []
        first = threading.Barrier(len(prompts) + 1, timeout=60)

        def stream(i: int) -> None:
            try:
                got_first = False
                for chunk in client.completions.create(model=str(tiny_llama_dir), prompt=prompts[i],
                                                       max_tokens=max_tokens, temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}):
                    texts[i].append(chunk.choices[0].text if chunk.choices else "")
                    if not got_first:
                        got_first = True
                        first.wait()
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
                first.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        first.wait()  # every request is streaming from w0
        os.kill(executors[0], signal.SIGKILL)
        assert worker.wait(15) == 1, "the worker did not exit 1 after its rank died"
        assert not [p for p in executors if os.path.exists(f"/proc/{p}") and
                    open(f"/proc/{p}/stat").read().split()[2] != "Z"], "an executor outlived its worker"
        fleet.start_worker("w1", "--num-kv-blocks", "256", "--no-warmup")  # takes the dead worker's requests
        for t in threads:
            t.join(120)
        assert not errors, f"{errors!r}\n{fleet.tail()}"
        assert ["".join(t) for t in texts] == want
        assert "stops serving: the engine is broken: tensor parallel: " in fleet.logs["w0"].read_text()


def test_launch_check_passes_on_cpu(tmp_path):
    """services/bench/tp_check.py, which device_check_tp.sh runs on N GPUs over NCCL, passes here over gloo."""
    import json
    import subprocess
    import sys

    from fleet_harness import REPO

    report = tmp_path / "tp_check.json"
    proc = subprocess.run([sys.executable, "-m", "services.bench.tp_check", "--device", "cpu",
                           "--tensor-parallel-size", "2", "--json", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(report.read_text())["checks"]
    assert set(checks) == {"same_tokens", "logprobs_within_tolerance", "dead_rank_reported",
                           "next_step_is_engine_fault", "nothing_left_running"} and all(checks.values())


@pytest.mark.slow
def test_a_tensor_parallel_worker_drains_and_leaves_nothing_running(tiny_llama_dir, tmp_path):
    """SIGTERM reaches rank 0 (the executors ignore it): the worker drains, tells its executors to stop, and
    exits 0; no executor outlives it."""
    with Fleet(tiny_llama_dir, tmp_path) as fleet:
        worker = fleet.start_worker("w0", "--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--no-warmup")
        fleet.start_gateway()
        fleet.wait_ready(workers=1)
        executors = fleet.wait_for(lambda: _executors(worker.pid), what="w0's executor process")
        out = fleet.client(timeout=60).completions.create(model=str(tiny_llama_dir), prompt="Once upon a time",
                                                          max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(30) == 0, fleet.tail()
        deadline = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{p}") for p in executors) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{p}") for p in executors), "an executor outlived its worker"


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_collectives_across_processes(size):
    """ShmComm between spawned processes (3 ranks on 2 cores too): every all-reduce equals the sum and every
    all-gather the concatenation, over many rounds of changing sizes (its two buffers used in turn)."""
    import torch.multiprocessing as mp
    from shm_ranks import rank_main

    from gpu_worker.executor.shm_comm import ShmComm

    ctx = mp.get_context("spawn")
    slots, counters = ShmComm.allocate(size, 1000)
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, size, slots, counters, 200, results)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert sorted(results.get(timeout=5) for _ in range(size)) == [(r, 200, "ok") for r in range(size)]


def test_shared_memory_wait_gives_up_when_told():
    """A collective waiting for a rank that will never come ends with ShmStalled once `abort` is set (rank 0's
    watcher sets it when a rank dies), instead of spinning forever."""
    import threading

    import torch

    from gpu_worker.executor.shm_comm import ShmComm, ShmStalled

    abort = threading.Event()
    comm = ShmComm(*ShmComm.allocate(2, 16), rank=0, size=2, abort=abort)
    threading.Timer(0.3, abort.set).start()
    started = time.monotonic()
    with pytest.raises(ShmStalled, match="never reached collective 1"):
        comm.all_reduce(torch.ones(4))
    assert time.monotonic() - started < 5
