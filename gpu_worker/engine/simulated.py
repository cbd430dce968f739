"""A simulated engine (`kvfleet worker --simulate PROFILE`): the real LLMEngine — scheduler, KV cache manager
with prefix caching, sampler, detokenizer — over a SimulatedRunner that sleeps out each step's cost instead of
running the model (gpu_worker.executor.simulated_runner).

It is light enough for 64 workers on a small machine: no weights are read (`kvfleet worker --simulate` runs torch
on one thread), only the model's config.json and tokenizer are loaded (a GGUF is de-quantized once per machine,
as for a real worker, to find them). The profile gives the KV cache size and the scheduler's limits unless they
are passed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.policies import SchedulingPolicy
from gpu_worker.engine.llm_engine import LLMEngine
from gpu_worker.engine.outputs import RequestOutput
from gpu_worker.executor.cost_model import CostProfile
from gpu_worker.executor.model_loader import checked_max_model_len, eos_token_ids, model_dir
from gpu_worker.executor.simulated_runner import SimulatedRunner


class SimulatedEngine(LLMEngine):
    """An LLMEngine whose steps last what the profile says, the engine's own work included: the runner's
    sleep counts from the start of the step, less the time the engine took after the previous forward
    (sampling, detokenizing), so a step costs step_seconds whenever the real work fits inside it."""

    runner: SimulatedRunner

    def __init__(self, runner: SimulatedRunner, tokenizer: Any, **kwargs: Any):
        super().__init__(runner, tokenizer, **kwargs)
        self.simulated = runner.profile.name
        self._tail_s = 0.0  # the engine's time after the last forward

    def step(self) -> list[RequestOutput]:
        self.runner.step_started = time.monotonic() - self._tail_s
        self.runner.execute_ended = None
        outputs = super().step()
        ended = self.runner.execute_ended
        self._tail_s = 0.0 if ended is None else min(time.monotonic() - ended, self.runner.last_step_s)
        self.runner.step_started = None
        return outputs


def load_tokenizer(directory: Path) -> Any:
    """The fast tokenizer from tokenizer.json (half AutoTokenizer's memory here); else AutoTokenizer."""
    if (directory / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer  # pragma: no cover - every shipped model has a tokenizer.json

    return AutoTokenizer.from_pretrained(directory)  # pragma: no cover


def simulated_engine(profile: str | Path | CostProfile, model: str, *, block_size: int | None = None,
                     num_kv_blocks: int | None = None, max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                     enable_prefix_caching: bool = True, scheduling_policy: str | SchedulingPolicy = "fcfs",
                     seed: int = 0, log_memory_usage_s: float = 0.0) -> SimulatedEngine:
    """An engine for `model`'s tokenizer and context window whose steps cost what `profile` (a CostProfile, a
    .json path or a name in gpu_worker/executor/profiles/) says. None: the profile's value."""
    prof = profile if isinstance(profile, CostProfile) else CostProfile.load(profile)
    directory = model_dir(model)
    config = SimpleNamespace(**json.loads((directory / "config.json").read_text()))
    tokenizer = load_tokenizer(directory)
    max_model_len = checked_max_model_len(config, max_model_len)
    block_size = block_size or prof.block_size
    num_blocks = num_kv_blocks or prof.num_kv_blocks
    eos = eos_token_ids(config, tokenizer)
    runner = SimulatedRunner(prof, vocab_size=config.vocab_size, block_size=block_size, num_blocks=num_blocks,
                             avoid_ids={*eos, *tokenizer.all_special_ids, *tokenizer.added_tokens_decoder},
                             token_range=len(tokenizer), seed=seed)
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs or prof.max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens or prof.max_num_batched_tokens,
                                max_model_len=max_model_len, policy=scheduling_policy,
                                log_memory_usage_s=log_memory_usage_s)
    cache_cfg = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching)
    return SimulatedEngine(runner, tokenizer, model_name=str(model), scheduler_config=sched_cfg,
                           cache_config=cache_cfg, eos_token_ids=eos, seed=seed)
