"""The worker's warm-up (gpu_worker.engine.warmup) on a real engine: every round runs to the end, nothing is
left running or holding blocks, and a request after it gives the same greedy tokens as on a cold engine."""

from __future__ import annotations

import pytest

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.warmup import WARMUP_BATCH, warm_up

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


def engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine.from_model(str(model_dir), block_size=4, num_kv_blocks=128, max_num_batched_tokens=64,
                                max_model_len=96, **kw)


def greedy(e: LLMEngine) -> list[int]:
    e.add_request("after", list(range(5, 40)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens: list[int] = []
    while e.has_unfinished_requests():
        for out in e.step():
            tokens += out.outputs[0].token_ids
    return tokens


def test_warm_up_runs_every_round_and_leaves_the_engine_as_it_found_it(tiny_llama_dir):
    cold = greedy(engine(tiny_llama_dir))
    e = engine(tiny_llama_dir)
    report = warm_up(e, seed=3)
    assert report.requests == 1 + WARMUP_BATCH + 1 + 1  # long, batch, n=2 with prompt logprobs, JSON-shaped
    # the JSON-shaped request stops as soon as its object is complete ("{}" then the stop token), at most 4
    assert 1 <= report.output_tokens - (4 + WARMUP_BATCH * 4 + 2 * 3) <= 4
    assert report.prompt_tokens == 64 + (WARMUP_BATCH + 2) * 24  # the long prompt: one full step's budget
    assert report.steps >= 4 and "warm-up: 11 requests" in report.describe()
    stats = e.stats()
    assert not e.has_unfinished_requests() and stats.num_running == stats.num_waiting == 0
    assert stats.free_blocks == stats.total_blocks  # cached blocks are free: the first evicted
    assert greedy(e) == cold


def test_warm_up_fits_a_small_cache(tiny_llama_dir):
    """A worker with a KV cache smaller than the long warm-up prompt: the prompt is cut to half the cache, nothing
    fails."""
    e = LLMEngine.from_model(str(tiny_llama_dir), block_size=4, num_kv_blocks=24, max_num_batched_tokens=64,
                             max_model_len=96)
    report = warm_up(e)
    assert report.prompt_tokens == (48 - 8) + (WARMUP_BATCH + 2) * 20  # short prompts: a quarter of the cache
    assert not e.has_unfinished_requests()


def test_warm_up_of_a_one_sequence_engine_skips_n2(tiny_llama_dir):
    e = LLMEngine.from_model(str(tiny_llama_dir), block_size=4, num_kv_blocks=128, max_num_seqs=1,
                             max_num_batched_tokens=64, max_model_len=96)
    report = warm_up(e)
    assert report.requests == 1 + WARMUP_BATCH + 1 and 1 <= report.output_tokens - (4 + WARMUP_BATCH * 4) <= 4


def test_warm_up_runs_the_full_step_on_every_forward_thread(tiny_llama_dir, two_torch_threads):
    """With 2 torch threads the runner splits a step into 2 concurrent forwards: the full-budget prefill runs once
    as one prompt (one forward on the caller's thread) and once as 2 prompts (one per forward thread)."""
    e = engine(tiny_llama_dir)
    assert e.runner.num_parts == 2
    report = warm_up(e)
    assert report.requests == 1 + 2 + WARMUP_BATCH + 1 + 1
    assert report.prompt_tokens == 64 + 2 * 32 + (WARMUP_BATCH + 2) * 24
    assert not e.has_unfinished_requests() and e.stats().free_blocks == e.stats().total_blocks
