"""The model runner of a simulated worker: no weights, no KV data; each step lasts what the cost profile says
and "generates" the cost model's deterministic tokens (gpu_worker.executor.cost_model).

It has the interface the engine uses of ModelRunner (execute, copy_blocks, num_blocks, vocab_size, device,
block_size), so the rest of the worker is the real one: scheduler, KV cache manager with prefix caching,
sampler, detokenizer, intake, outbox, status. execute returns, for each sampling sequence, logits that are 0
at the chosen token and LOSER_LOGIT elsewhere: the sampler picks that token under greedy and under random
sampling alike (any temperature, top-k/p, min-p), and penalties and logit_bias cannot move another above it.
The token at position p of a sequence is sim_token(seed, request id, p): the same on any worker, after a
takeover or a preemption (recomputed tokens land on the same positions). Prompt logprobs are those logits'
too: a prompt token is ~0 where the simulated model would have chosen it, LOSER_LOGIT below that elsewhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch

from gpu_worker.core.sched_output import SchedulerOutput
from gpu_worker.executor.cost_model import CostProfile, StepShape, sim_token
from gpu_worker.executor.prompt_logprobs import PromptLogprobs

# Every token but the chosen one. Finite, so logprobs stay numbers in JSON; low enough that the largest
# logit_bias (+100), a penalty or a temperature (0.01..2) leaves the chosen token (at 0) far ahead.
LOSER_LOGIT = -1.0e4


class SimulatedRunner:
    def __init__(self, profile: CostProfile, *, vocab_size: int, block_size: int, num_blocks: int,
                 avoid_ids: Iterable[int] = (), token_range: int | None = None, seed: int = 0,
                 sleep: Callable[[float], None] = time.sleep):
        """token_range: tokens are drawn from [0, token_range) (the tokenizer's size when the model's
        vocabulary is padded beyond it), less avoid_ids (EOS, special and added tokens)."""
        self.profile = profile
        self.device = torch.device("cpu")
        self.vocab_size, self.block_size, self.num_blocks = vocab_size, block_size, num_blocks
        self.avoid = frozenset(avoid_ids)
        self.token_range = min(token_range or vocab_size, vocab_size)
        self.seed = seed
        self._sleep = sleep
        # Set by the engine before a step (gpu_worker.engine.simulated): the step's duration counts from here,
        # so the scheduler's and sampler's real work is part of it rather than added on top. None: from the call.
        self.step_started: float | None = None
        self.execute_ended: float | None = None  # when the last execute returned
        self.last_shape: StepShape | None = None
        self.last_step_s = 0.0  # what the profile gave the last step
        self.last_sleep_s = 0.0  # how long it slept for it
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        # log-sum-exp of a row of these logits: one 0, vocab_size - 1 at LOSER_LOGIT
        self._norm = math.log1p((vocab_size - 1) * math.exp(LOSER_LOGIT))

    def fault(self) -> str | None:
        return None

    def paths(self) -> dict[str, str]:
        return {"forward": f"simulated ({self.profile.name}): each step sleeps for its cost"}

    def close(self) -> None:
        pass

    def token(self, request_id: str, position: int) -> int:
        """The token the simulated model emits at `position` (0-based, prompt included) of a sequence."""
        return sim_token(self.seed, request_id, position, self.token_range, self.avoid)

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        out, self._prompt_logprobs = self._prompt_logprobs, {}
        return out

    def _score_prompt(self, request_id: str, first: int, targets: list[int], top_n: int) -> PromptLogprobs:
        """Position first + i holds targets[i]; the simulated model's choice there scores ~0, any other token
        LOSER_LOGIT less; the top N are its choice, then the lowest other ids."""
        entries, ranks = [], []
        for i, target in enumerate(targets):
            choice = self.token(request_id, first + i)
            top = ([choice] + [t for t in range(top_n) if t != choice])[:top_n]
            entry = {target: (0.0 if target == choice else LOSER_LOGIT) - self._norm}
            for t in top:
                entry.setdefault(t, (0.0 if t == choice else LOSER_LOGIT) - self._norm)
            entries.append(entry)
            ranks.append(1 if target == choice else 2)  # ties: every other token is second
        return PromptLogprobs(first, entries, ranks)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: there is no KV data to copy."""

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """-> logits [num sample=True seqs, vocab] float32, in batch order, after the step's simulated time."""
        began = time.monotonic()
        if self.step_started is not None:
            began, self.step_started = min(began, self.step_started), None
        if not sched.seqs:
            return torch.empty(0, self.vocab_size)
        self.last_shape = StepShape.of(sched)
        self.last_step_s = self.profile.step_seconds(self.last_shape)
        # the token being generated sits at position context_len: right after every token computed so far
        chosen = [self.token(s.request_id, s.context_len) for s in sched.seqs if s.sample]
        for s in sched.seqs:
            if s.prompt_logprob_targets:
                self._prompt_logprobs[s.request_id] = self._score_prompt(
                    s.request_id, s.start_pos + 1, s.prompt_logprob_targets, s.num_prompt_logprobs)
        logits = torch.full((len(chosen), self.vocab_size), LOSER_LOGIT)  # [N, V]
        logits[torch.arange(len(chosen)), torch.tensor(chosen, dtype=torch.long)] = 0.0
        self.last_sleep_s = max(0.0, began + self.last_step_s - time.monotonic())
        if self.last_sleep_s > 0:
            self._sleep(self.last_sleep_s)
        self.execute_ended = time.monotonic()
        return logits
