"""Warm-up: run every path the engine will serve with once, before the worker takes requests, so the first
user pays nothing extra (no lazy kernel builds, first-touch page faults, allocator growth or first-call
dispatch in the middle of their request).

Three small rounds through the real engine API (scheduler, KV cache, runner, sampler, detokenizer): a long
prefill of the engine's largest step (max_num_batched_tokens tokens, capped by the context window and half the
KV cache), so that the first full step of real load finds its activations' memory already mapped (2-core Zen 5,
default model, float32: the first 2,048-token step after a 512-token warm-up took 1.57 s, the next ones
1.28-1.41 s: that 0.2-0.3 s was on every first token of the load), with greedy decoding, once as one prompt
(a one-sequence step runs on the caller's thread) and once as one prompt per concurrent forward (the model
runner's forward threads: each thread's allocator arena grows in its own first large step); a batch
of short requests decoding together with seeded sampling, top-p/top-k, penalties and logprobs; and n=2 (a
forked prompt, copy-on-write) scoring its prompt (prompt logprobs); then a JSON-constrained request (structured
outputs: the grammar library's import and this tokenizer's tables, ~0.5 s the first time; a tokenizer it cannot
read is logged, not fatal: such requests then fail alone). The prompts are fixed ids drawn from a seed, so their cached blocks match no
real prompt and are the first evicted. Then it waits until the KV cache is resident (on CPU the runner
pre-faults it in the background from its start: gpu_worker.executor.kv_prefault), as vLLM's start zeroes its
cache. Returns what it did and how long it took, for the start log.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from gpu_worker.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams

WARMUP_BATCH = 8  # short requests decoding together
WARMUP_PREFIX = "kvfleet-warmup"

log = logging.getLogger(__name__)


@dataclass
class Warmup:
    seconds: float
    steps: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    kv_wait_s: float = 0.0  # then waiting for the KV cache to be resident (gpu_worker.executor.kv_prefault)

    def describe(self) -> str:
        return (f"warm-up: {self.requests} requests ({self.prompt_tokens} prompt, {self.output_tokens} output "
                f"tokens) in {self.steps} steps, {self.seconds:.2f} s"
                + (f", then {self.kv_wait_s:.1f} s until the KV cache was resident" if self.kv_wait_s >= 0.05 else ""))


def warm_up(engine: LLMEngine, *, seed: int = 0) -> Warmup:
    rng = random.Random(seed)
    vocab_size, max_model_len = engine.runner.vocab_size, engine.max_model_len
    low = min(1000, vocab_size // 2)  # clear of the special tokens most vocabularies start with

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    room = min(max_model_len, engine.stats().total_blocks * engine.block_size // 2) - 8  # fits any cache
    long_len = max(1, min(engine.scheduler.config.max_num_batched_tokens, room))
    short_len = max(1, min(24, room // 2))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=4, ignore_eos=True,
                             logprobs=2, repetition_penalty=1.1, presence_penalty=0.1)
    forked = SamplingParams(n=2, temperature=0.7, seed=seed, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    shaped = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"json_object": True})
    rounds = [[(ids(long_len), greedy)]]
    parts = min(getattr(engine.runner, "num_parts", 1), engine.scheduler.config.max_num_seqs)
    if parts > 1:  # the same step as `parts` prompts: each concurrent forward thread runs its share
        rounds.append([(ids(max(1, long_len // parts)), greedy) for _ in range(parts)])
    rounds.append([(ids(short_len), sampled) for _ in range(WARMUP_BATCH)])
    if engine.scheduler.config.max_num_seqs >= forked.n:
        rounds.append([(ids(short_len), forked)])
    start, steps, requests, prompt_tokens, output_tokens = time.perf_counter(), 0, 0, 0, 0
    try:
        engine.grammars.compile(shaped.structured_outputs)
        rounds.append([(ids(short_len), shaped)])
    except Exception as e:  # noqa: BLE001 (an optional path: the worker serves everything else)
        log.warning("structured outputs will fail on this worker: %s", e)
    for round_ in rounds:
        for prompt, params in round_:
            engine.add_request(f"{WARMUP_PREFIX}-{requests}", prompt, params)
            requests += 1
            prompt_tokens += len(prompt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(f"the warm-up request {out.request_id} failed: {out.error}")
                output_tokens += sum(len(o.token_ids) for o in out.outputs)
            steps += 1
    seconds = time.perf_counter() - start
    return Warmup(seconds, steps, requests, prompt_tokens, output_tokens, kv_wait_s=engine.wait_kv_resident())
