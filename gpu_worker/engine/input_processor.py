"""From an accepted request to the engine's state for it (vLLM v1's input processor): what this model can run
is checked (token ids in its vocabulary, top_k up to it, a grammar that compiles: InvalidRequest else), and the
request becomes a RequestState with one SequenceState per sample. Each sample gets the scheduler's Request, its
detokenizer, its seeded generator and its grammar. The model's extra end-of-text ids (Llama 3) become stop ids;
sample i of n is seeded seed + i. A request resumed after a takeover starts from the tokens already sent: they
are recomputed, not sampled again, and the generator and the grammar are moved past them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gpu_worker.core.request import Request
from gpu_worker.core.scheduler import RequestRejected
from gpu_worker.engine.detokenizer import IncrementalDetokenizer, backend_decode
from gpu_worker.engine.outputs import RequestMetrics
from gpu_worker.engine.request_state import RequestState, SequenceState
from gpu_worker.engine.sampler import draw_uniform
from gpu_worker.engine.structured import Constraint, GrammarError, Grammars
from shared.sampling_params import SamplingParams


class InvalidRequest(RequestRejected):
    """A request no worker of this model can run (a field out of range): fail it, never hand it on."""


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], device: torch.device):
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self._decode = backend_decode(tokenizer)  # the detokenizers' decode, where it is transformers' own
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._extra_eos_ids = eos_token_ids[1:]  # more end-of-text ids (Llama 3): treated as stop ids
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What the engine needs beyond SamplingParams' own checks: token ids in this model's vocabulary and
        top_k up to it (the producer may have skipped the gateway's validation)."""
        vocab = self.vocab_size

        def outside(ids: Any) -> Any:
            return next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)

        if (bad := outside(prompt_token_ids)) is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if (bad := outside(params.stop_token_ids)) is not None:
            raise InvalidRequest(f"stop_token_ids: {bad!r} is outside the vocabulary [0, {vocab})")
        if (bad := outside(params.logit_bias or {})) is not None:  # SamplingParams made the keys ints
            raise InvalidRequest(f"logit_bias: key {bad!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(params.top_k, int) or not 0 <= params.top_k <= vocab:
            raise InvalidRequest(f"top_k must be -1 (off) or in [1, {vocab}] (the vocabulary), got {params.top_k!r}")
        if params.structured_outputs is not None:
            try:
                self.grammars.compile(params.structured_outputs)
            except GrammarError as e:
                raise InvalidRequest(str(e)) from None

    def new_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int, arrival: float, resume: list[list[int]]) -> RequestState:
        """The checked request's state; `resume`: per sample, the tokens already sent (may be shorter than n)."""
        self.check(prompt_token_ids, params)
        state = RequestState(request_id, prompt, list(prompt_token_ids), metrics=RequestMetrics(arrival))
        for i in range(params.n):
            state.seqs.append(self._sequence(state, i, params, priority, arrival, resume[i] if i < len(resume) else []))
        return state

    def _sequence(self, state: RequestState, index: int, params: SamplingParams, priority: int, arrival: float,
                  resumed: list[int]) -> SequenceState:
        sp = params
        if params.n > 1 or self._extra_eos_ids:
            sp = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                                     stop_token_ids=params.stop_token_ids + [
                                         e for e in self._extra_eos_ids if not params.ignore_eos])
        rid = state.request_id if params.n == 1 else f"{state.request_id}-{index}"
        request = Request(rid, state.prompt_token_ids, sp, eos_token_id=self.eos_token_id, priority=priority,
                          arrival_time=arrival, output_token_ids=list(resumed))
        generator = None
        if sp.seed is not None and not sp.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sp.seed)
            for _ in resumed:  # the draws those tokens took, so the continuation is the same
                draw_uniform(generator, 1, self.device)
        banned = list(sp.stop_token_ids)
        if self.eos_token_id is not None and not sp.ignore_eos:
            banned.append(self.eos_token_id)
        detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                       skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
                                       include_stop_str_in_output=sp.include_stop_str_in_output,
                                       decode=self._decode)
        if resumed:  # their text was sent too: all of it but what a stop string could still begin with
            detok.add_tokens(resumed)
            detok.take_text(finished=False)
        want_lp = sp.logprobs is not None
        constraint = None
        if sp.structured_outputs is not None:
            try:
                constraint = Constraint(self.grammars.compile(sp.structured_outputs), resumed)
            except GrammarError as e:
                raise InvalidRequest(str(e)) from None
        return SequenceState(index, request, detok, generator, banned, num_seen=len(resumed), num_sent=len(resumed),
                             logprobs=[] if want_lp else None, cumulative_logprob=0.0 if want_lp else None,
                             constraint=constraint)
