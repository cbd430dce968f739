"""Prompt logprobs (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`): for each prompt position the
logprob of the prompt token that follows, and the top N there, from the raw logits (before any sampling
parameter), as the sampler's logprobs of sampled tokens are.

The rows are scored a slice at a time: a 2,048-token chunk's logits over a 49,152-token vocabulary would be
400 MB of float32 at once. Each row is logits - logsumexp(logits); no log-softmax of the whole slice is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SLICE_ROWS = 256  # rows of logits alive at once: 256 x 49,152 float32 is 50 MB


@dataclass
class PromptLogprobs:
    """One chunk's prompt logprobs: entries[i] and ranks[i] are for prompt token first_position + i."""

    first_position: int
    entries: list[dict[int, float]]  # the target's logprob first, then the top N (those not already in)
    ranks: list[int]  # the target's rank there: 1 + how many tokens are likelier


def score_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int],
               top_n: int) -> tuple[list[dict[int, float]], list[int]]:
    """hidden [len(targets), H]: the hidden states of the positions before each target -> (one entry per target,
    {target: logprob, top-N ids: logprobs}; the targets' ranks). `compute_logits`: [R, H] -> float32 [R, V] (under
    tensor parallelism a collective: every rank calls it with the same row counts)."""
    want = torch.tensor(targets, dtype=torch.long, device=hidden.device)  # [T]
    entries: list[dict[int, float]] = []
    ranks: list[int] = []
    for lo in range(0, len(targets), SLICE_ROWS):
        logits = compute_logits(hidden[lo:lo + SLICE_ROWS])  # [R, V]
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
        target_logits = logits.gather(1, want[lo:lo + SLICE_ROWS, None])  # [R, 1]
        ranks += ((logits > target_logits).sum(dim=-1) + 1).tolist()
        chosen = (target_logits - norm)[:, 0].tolist()
        top_ids: list[list[int]] = [[] for _ in chosen]
        top_vals: list[list[float]] = top_ids
        if top_n:
            vals, ids = logits.topk(top_n, dim=-1)  # [R, N]
            top_vals, top_ids = vals.sub_(norm).tolist(), ids.tolist()
        for j, value in enumerate(chosen):
            entry = {targets[lo + j]: value}
            for tid, v in zip(top_ids[j], top_vals[j], strict=True):
                entry.setdefault(tid, v)
            entries.append(entry)
    return entries, ranks
