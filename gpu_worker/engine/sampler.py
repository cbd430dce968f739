"""The sampler: logits of one step -> one token per row, vLLM's semantics.

Order: min_tokens masking (eos / stop ids) -> repetition penalty (prompt + output) -> presence and
frequency penalties (output) -> greedy argmax, or temperature -> min-p -> top-k -> top-p -> a draw.
Each seeded request draws from its own torch.Generator (one exponential race over the vocabulary per
token), so its tokens do not depend on what else is in the batch. Logprobs are vLLM's default "raw"
logprobs: log_softmax of the model's logits before any processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row's request."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # eos / stop ids while fewer than min_tokens outputs exist
    generator: torch.Generator | None  # the request's own (seeded) generator


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # chosen + top-N raw logprobs, None where not requested


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, only on the rows that use a penalty."""
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        idx = torch.tensor(rep, device=logits.device)
        seen = torch.zeros(len(rep), logits.shape[1], dtype=torch.bool, device=logits.device)  # [R, V]
        for j, i in enumerate(rep):
            ids = rows[i].prompt_token_ids + rows[i].output_token_ids
            seen[j, torch.tensor(ids, dtype=torch.long, device=logits.device)] = True
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep],
                               device=logits.device)[:, None]  # [R, 1]
        sub = logits[idx]
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        logits[idx] = sub
    pf = [i for i, r in enumerate(rows)
          if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
    if pf:
        idx = torch.tensor(pf, device=logits.device)
        counts = torch.zeros(len(pf), logits.shape[1], device=logits.device)  # [R, V]
        for j, i in enumerate(pf):
            ids = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
            counts[j].index_add_(0, ids, torch.ones(len(ids), device=logits.device))
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pf], device=logits.device)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pf], device=logits.device)[:, None]
        logits[idx] -= freq * counts + pres * (counts > 0).float()


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [R, V] -> logits with the filtered-out tokens at -inf.
    top_k [R] (0 = off), top_p [R] (1 = off), min_p [R] (0 = off)."""
    vocab = logits.shape[1]
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [R, 1]: the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # keep a token when the mass before it is < top_p (the top token always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits


def _draw(probs: torch.Tensor, rows: list[SamplingRow], default: torch.Generator | None) -> torch.Tensor:
    """Exponential race (argmax probs / Exp(1)): one draw of V exponentials per row and token; seeded rows
    from their own generator, the rest together from the engine's."""
    q = torch.empty_like(probs)  # [R, V]
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if len(shared) == len(rows):
        q.exponential_(generator=default)
    else:
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            q[idx] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(generator=default)
    return (probs / q).argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [N, V] float32, one row per SamplingRow; the sampler owns it (modified in place)."""
        device = logits.device
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        want_idx = torch.tensor(want, device=device)
        raw_logprobs = logits[want_idx].log_softmax(dim=-1) if want else None  # [W, V], before processing
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if t < logits.shape[1]]
        if banned:
            r_idx, t_idx = zip(*banned, strict=True)
            logits[list(r_idx), list(t_idx)] = float("-inf")
        apply_penalties(logits, rows)

        tokens = logits.argmax(dim=-1)  # [N]: greedy rows keep this
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=device)
            params = [rows[i].params for i in rand]
            temp = torch.tensor([p.temperature for p in params], device=device)[:, None]
            sub = filter_logits(logits[idx] / temp,
                                torch.tensor([p.top_k for p in params], device=device),
                                torch.tensor([p.top_p for p in params], device=device),
                                torch.tensor([p.min_p for p in params], device=device))
            tokens[idx] = _draw(sub.softmax(dim=-1), [rows[i] for i in rand], self.generator)

        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[want_idx][:, None])[:, 0].tolist()
            top_n = max(rows[i].params.logprobs for i in want)
            top_vals, top_ids = raw_logprobs.topk(top_n, dim=-1) if top_n else (raw_logprobs[:, :0],
                                                                              raw_logprobs[:, :0].long())
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                n = rows[i].params.logprobs
                entry = {token_list[i]: chosen[j]}
                for tid, val in zip(top_ids[j][:n], top_vals[j][:n], strict=True):
                    entry.setdefault(tid, val)
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)
