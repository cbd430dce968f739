"""The sampler: logits of one step -> one token per row, vLLM's semantics.

Order: logit_bias -> min_tokens masking (eos / stop ids) -> repetition penalty (prompt + output) -> presence and
frequency penalties (output) -> greedy argmax, or temperature -> min-p -> top-k -> top-p -> a draw.
Each seeded request draws from its own torch.Generator (one uniform per token, looked up in the
cumulative probabilities), so its tokens do not depend on what else is in the batch. Logprobs are vLLM's default "raw"
logprobs: log_softmax of the model's logits before any processing.

A row's parameters become tensors first (`_Plan`), before the logits or any generator is touched: a row
whose parameters cannot be used makes the call raise with everything unchanged, so the engine can sample
the rows again one by one and fail only that row's request (gpu_worker.engine.isolation).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
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


def _padded(rows: list[list], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Lists -> [R, L], each padded with its own first value: a repeated (id, value) pair writes the same
    value back, so padding changes nothing."""
    width = max(len(x) for x in rows)
    return torch.tensor([x + [x[0]] * (width - len(x)) for x in rows], dtype=dtype, device=device)


def _in_vocab(ids: list[list[int]], vocab: int) -> None:
    for x in ids:
        if min(x) < 0 or max(x) >= vocab:
            raise IndexError(f"token id out of the vocabulary [0, {vocab}): {min(x) if min(x) < 0 else max(x)}")


class _Penalties:
    """The penalties of the rows that use one, on the tokens they touch only (gathered, changed, written back):
    a row's prompt and output ids for the repetition penalty, its output ids and their counts for presence and
    frequency. `apply` changes the logits in place. (Tensors over the whole vocabulary cost 20-30 ms a step for
    64 rows of SmolLM2's 49,152 tokens with 500 ids each on a 2-core Zen 3; these, 2-5 ms.)"""

    def __init__(self, rows: list[SamplingRow], vocab: int, device: torch.device):
        rep = [(i, list(set(r.prompt_token_ids + r.output_token_ids))) for i, r in enumerate(rows)
               if r.params.repetition_penalty != 1.0]
        rep = [(i, ids) for i, ids in rep if ids]
        self.rep = [i for i, _ in rep]
        if rep:
            _in_vocab([ids for _, ids in rep], vocab)
            self.rep_rows = torch.tensor(self.rep, dtype=torch.long, device=device)[:, None]  # [R, 1]
            self.rep_ids = _padded([ids for _, ids in rep], device)  # [R, L]
            # [R, 1], at least float32's smallest normal: 5e-324 (accepted: > 0) would round to 0 in float32, and a
            # masked (-inf) logit times 0 is NaN, which greedy argmax takes for the largest (a masked token chosen)
            self.penalty = torch.tensor([rows[i].params.repetition_penalty for i in self.rep],
                                        device=device)[:, None].clamp_(min=torch.finfo(torch.float32).tiny)
        pf = [(i, Counter(r.output_token_ids)) for i, r in enumerate(rows)
              if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
        self.pf = [i for i, _ in pf]
        if pf:
            _in_vocab([list(c) for _, c in pf], vocab)
            self.pf_rows = torch.tensor(self.pf, dtype=torch.long, device=device)[:, None]
            self.pf_ids = _padded([list(c) for _, c in pf], device)
            self.counts = _padded([list(c.values()) for _, c in pf], device, torch.float32)  # [R, L], each > 0
            self.freq = torch.tensor([rows[i].params.frequency_penalty for i in self.pf], device=device)[:, None]
            self.pres = torch.tensor([rows[i].params.presence_penalty for i in self.pf], device=device)[:, None]

    def apply(self, logits: torch.Tensor) -> None:
        if self.rep:
            vals = logits[self.rep_rows, self.rep_ids]
            logits[self.rep_rows, self.rep_ids] = torch.where(vals > 0, vals / self.penalty, vals * self.penalty)
        if self.pf:
            vals = logits[self.pf_rows, self.pf_ids]
            logits[self.pf_rows, self.pf_ids] = vals - (self.freq * self.counts + self.pres)


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


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: tokens with p < min_p * p_max to -inf, compared as logits (logit < max + log(min_p)), so no
    softmax of the whole vocabulary is needed; min_p 0 keeps everything."""
    if bool((min_p > 0).any()):
        floor = logits.max(dim=-1, keepdim=True).values + min_p[:, None].log()  # [R, 1]; log 0 = -inf
        logits.masked_fill_(logits < floor, float("-inf"))


def draw_uniform(generator: torch.Generator | None, n: int, device: torch.device | str) -> torch.Tensor:
    """n uniforms in [0, 1), float32: what one sampled token takes from a row's generator (n = 1)."""
    return torch.rand(n, generator=generator, device=device)


def _uniforms(rows: list[SamplingRow], default: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform per row [R]: seeded rows from their own generator, the rest together from the engine's."""
    if all(r.generator is None for r in rows):
        return draw_uniform(default, len(rows), device)
    u = torch.empty(len(rows), device=device)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = draw_uniform(r.generator, 1, device)[0]
    if shared:
        u[torch.tensor(shared, device=device)] = draw_uniform(default, len(shared), device)
    return u


def _pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: weights [R, C] (unnormalized, >= 0; changed in place into their running sums), u [R] in
    [0, 1) -> the index [R] of the first weight whose running sum passes u * total. A zero weight is never
    picked. The float32 running sum moves a token's probability by at most half an ulp (~3e-8)."""
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1:].contiguous()  # [R, 1]
    chosen = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # u * total can round up to total: the last real one
    return torch.minimum(chosen, last)[:, 0].clamp_(max=weights.shape[1] - 1)  # (a row of NaN: the last one)


def _rows(x: torch.Tensor, idx: list[int], everything: bool) -> torch.Tensor:
    return x if everything else x[torch.tensor(idx, device=x.device)]


def nucleus(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, size: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p (of the renormalized top-k mass) over each row's `size` largest logits (or its top_k,
    if larger). x [S, V] temperature-scaled logits, top_k [S] (0 = off), top_p [S] (1 = off) ->
    token ids [S, C], their probabilities after the filters [S, C] (unnormalized, 0 for a token filtered
    out) and spill [S]: rows whose nucleus reaches past the candidates, for which the first two mean nothing.
    With size >= V it is the whole vocabulary sorted, and nothing spills."""
    vocab = x.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [S]
    size = min(vocab, max(size, int(torch.where(top_k > 0, top_k, 0).max())))
    vals, ids = x.topk(size, dim=-1)  # [S, C], largest first
    vals.masked_fill_(torch.arange(size, device=x.device)[None, :] >= k[:, None], float("-inf"))
    whole_set = k > size  # top-k reaches past the candidates: top-p renormalizes over the whole vocabulary
    probs = vals.softmax(dim=-1)  # [S, C]
    if bool(whole_set.any()):
        probs = torch.where(whole_set[:, None], x.softmax(dim=-1).gather(1, ids), probs)
    held = probs.sum(dim=-1)  # the candidates' share of the mass top-p is taken of
    mass_before = probs.cumsum(dim=-1) - probs
    probs.masked_fill_(mass_before >= top_p[:, None], 0.0)  # keep while the mass before is < top_p
    return ids, probs, whole_set & (held < top_p)


CANDIDATES = (1024, 8192)  # the largest logits a top-k / top-p row draws from, before the whole vocabulary


def _draw_random(x: torch.Tensor, plan: _Plan, rows: list[SamplingRow], default: torch.Generator | None
                 ) -> torch.Tensor:
    """The draw for the rows that are not greedy, on their temperature-scaled logits [R, V] (owned: changed in
    place). A row without top-k or top-p draws over the whole vocabulary (softmax, inverse CDF). One
    with them draws from its largest logits, CANDIDATES at first; a row whose top-p nucleus reaches past them
    tries the next size, and the whole vocabulary sorted last. Sorting 49,152 logits costs ~2 ms a row on a
    Zen 3 core, the 1,024 largest a quarter of that; SmolLM2's nucleus at top_p 0.95 and temperature 1 holds
    374 tokens at the median, 1,843 at p90. Every row takes one uniform per token, whichever path it takes."""
    u = _uniforms(rows, default, x.device)
    # extreme parameters (a repetition_penalty of 5e-324) can make logits infinite: an infinite logit is the
    # certain token, a NaN an impossible one
    x.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    _apply_min_p(x, plan.min_p)
    tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
    narrow = ((plan.top_k > 0) | (plan.top_p < 1)).tolist()
    whole = [i for i, n in enumerate(narrow) if not n]
    if whole:  # softmax, not exp: torch's exp takes a slow path (10-30x) for the underflowing tail
        tokens[whole] = _pick(_rows(x, whole, len(whole) == len(rows)).softmax(dim=-1), u[whole])
    pending = torch.tensor([i for i, n in enumerate(narrow) if n], dtype=torch.long, device=x.device)
    for size in (*CANDIDATES, x.shape[1]):
        if not len(pending):
            break
        ids, probs, spill = nucleus(_rows(x, pending.tolist(), len(pending) == len(rows)), plan.top_k[pending],
                                    plan.top_p[pending], size)
        done = ~spill
        tokens[pending[done]] = ids[done].gather(1, _pick(probs[done], u[pending[done]])[:, None])[:, 0]
        pending = pending[spill]
    return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the native kernel on CPU (one pass, rows over the threads: 64 x 49,152 fresh logits
    0.36 against torch's 1.05 ms, 2-core Zen 5), torch's elsewhere; the same choice of ties and NaN."""
    tokens = cpu_kernels.argmax(logits)
    return logits.argmax(dim=-1) if tokens is None else tokens


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

        every = len(plan.rand) == len(rows)
        # [N]: greedy rows keep their argmax
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device) if every else _argmax(logits)
        if plan.rand:
            x = logits.div_(plan.temp) if every else logits[plan.rand_idx].div_(plan.temp)
            tokens[plan.rand_idx] = _draw_random(x, plan, [rows[i] for i in plan.rand], self.generator)

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
