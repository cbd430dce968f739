"""The sampler: logits of one step -> one token per row, vLLM's semantics.

Order: logit_bias -> min_tokens masking (eos / stop ids) -> repetition penalty (prompt + output) -> presence and
frequency penalties (output) -> greedy argmax, or temperature -> min-p -> top-k -> top-p -> a draw.
Each seeded request draws from its own torch.Generator (one exponential race over the vocabulary per
token), so its tokens do not depend on what else is in the batch. Logprobs are vLLM's default "raw"
logprobs: log_softmax of the model's logits before any processing.

A row's parameters become tensors first (`_Plan`), before the logits or any generator is touched: a row
whose parameters cannot be used makes the call raise with everything unchanged, so the engine can sample
the rows again one by one and fail only that row's request (gpu_worker.engine.isolation).
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


class _Penalties:
    """The penalty tensors of the rows that use one; `apply` changes the logits in place."""

    def __init__(self, rows: list[SamplingRow], vocab: int, device: torch.device):
        self.rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if self.rep:
            self.seen = torch.zeros(len(self.rep), vocab, dtype=torch.bool, device=device)  # [R, V]
            for j, i in enumerate(self.rep):
                ids = rows[i].prompt_token_ids + rows[i].output_token_ids
                self.seen[j, torch.tensor(ids, dtype=torch.long, device=device)] = True
            self.rep_idx = torch.tensor(self.rep, device=device)
            self.penalty = torch.tensor([rows[i].params.repetition_penalty for i in self.rep],
                                        device=device)[:, None]  # [R, 1]
        self.pf = [i for i, r in enumerate(rows)
                   if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
        if self.pf:
            self.counts = torch.zeros(len(self.pf), vocab, device=device)  # [R, V]
            for j, i in enumerate(self.pf):
                ids = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=device)
                self.counts[j].index_add_(0, ids, torch.ones(len(ids), device=device))
            self.pf_idx = torch.tensor(self.pf, device=device)
            self.freq = torch.tensor([rows[i].params.frequency_penalty for i in self.pf], device=device)[:, None]
            self.pres = torch.tensor([rows[i].params.presence_penalty for i in self.pf], device=device)[:, None]

    def apply(self, logits: torch.Tensor) -> None:
        if self.rep:
            sub = logits[self.rep_idx]
            sub = torch.where(self.seen, torch.where(sub > 0, sub / self.penalty, sub * self.penalty), sub)
            logits[self.rep_idx] = sub
        if self.pf:
            logits[self.pf_idx] -= self.freq * self.counts + self.pres * (self.counts > 0).float()


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place, only on the rows that use a penalty."""
    _Penalties(rows, logits.shape[1], logits.device).apply(logits)


class _Plan:
    """Every per-row tensor one call needs, built from the rows' parameters before anything is changed."""

    def __init__(self, rows: list[SamplingRow], vocab: int, device: torch.device):
        self.want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        self.want_idx = torch.tensor(self.want, dtype=torch.long, device=device)
        self.top_n = max((rows[i].params.logprobs for i in self.want), default=0)
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if 0 <= t < vocab]
        self.banned = (torch.tensor([i for i, _ in banned], dtype=torch.long, device=device),
                       torch.tensor([t for _, t in banned], dtype=torch.long, device=device)) if banned else None
        bias = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items() if 0 <= t < vocab]
        self.bias = ((torch.tensor([i for i, _, _ in bias], dtype=torch.long, device=device),
                      torch.tensor([t for _, t, _ in bias], dtype=torch.long, device=device)),
                     torch.tensor([b for _, _, b in bias], dtype=torch.float32, device=device)) if bias else None
        self.penalties = _Penalties(rows, vocab, device)
        self.rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if self.rand:
            params = [rows[i].params for i in self.rand]
            self.rand_idx = torch.tensor(self.rand, device=device)
            self.temp = torch.tensor([p.temperature for p in params], device=device)[:, None]  # [R, 1]
            self.top_k = torch.tensor([p.top_k for p in params], device=device)
            self.top_p = torch.tensor([p.top_p for p in params], device=device)
            self.min_p = torch.tensor([p.min_p for p in params], device=device)


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
        """logits: [N, V] float32, one row per SamplingRow; the sampler owns it (modified in place). Raises
        with `logits` and every generator untouched when a row's parameters cannot be turned into tensors."""
        plan = _Plan(rows, logits.shape[1], logits.device)
        raw_logprobs = logits[plan.want_idx].log_softmax(dim=-1) if plan.want else None  # [W, V], raw
        if plan.bias is not None:
            where, values = plan.bias
            logits.index_put_(where, values, accumulate=True)
        if plan.banned is not None:
            logits[plan.banned] = float("-inf")
        plan.penalties.apply(logits)

        tokens = logits.argmax(dim=-1)  # [N]: greedy rows keep this
        if plan.rand:
            sub = filter_logits(logits[plan.rand_idx] / plan.temp, plan.top_k, plan.top_p, plan.min_p)
            tokens[plan.rand_idx] = _draw(sub.softmax(dim=-1), [rows[i] for i in plan.rand], self.generator)

        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens[plan.want_idx][:, None])[:, 0].tolist()
            top_n = plan.top_n
            top_vals, top_ids = raw_logprobs.topk(top_n, dim=-1) if top_n else (raw_logprobs[:, :0],
                                                                              raw_logprobs[:, :0].long())
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, i in enumerate(plan.want):
                n = rows[i].params.logprobs
                entry = {token_list[i]: chosen[j]}
                for tid, val in zip(top_ids[j][:n], top_vals[j][:n], strict=True):
                    entry.setdefault(tid, val)
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)
