"""What the engine keeps of a request beside the scheduler's Requests, and how it turns a step's tokens into the
request's delta output (vLLM v1's OutputProcessor and its RequestState).

A request is one RequestState over n SequenceStates, one per sample. A sample keeps its detokenizer, seeded
generator, grammar, logprobs, and how far its tokens were processed (detokenized, stop strings checked) and
sent. Its RequestState keeps the prompt, the metrics and the prompt logprobs, which go out once, in the first
output with tokens. Tokens a request already had (resumed after a takeover, recomputed after a preemption)
count as sent: they never go out again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from gpu_worker.core.kv_cache_manager import compute_block_hashes
from gpu_worker.core.request import Request
from gpu_worker.engine.detokenizer import IncrementalDetokenizer
from gpu_worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gpu_worker.engine.scored_prefixes import ScoredPrefixes
from gpu_worker.engine.structured import Constraint
from gpu_worker.executor.prompt_logprobs import PromptLogprobs


@dataclass
class SequenceState:
    """One of a request's n samples, with what the engine adds to the scheduler's Request."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    banned_ids: list[int]  # masked while fewer than min_tokens outputs exist
    num_seen: int  # output tokens already processed (detokenized, logprobs recorded)
    num_sent: int  # output tokens already in an output (or sent before a takeover)
    logprobs: list[dict[int, float]] | None  # of the processed tokens not sent yet; None if not asked
    cumulative_logprob: float | None
    constraint: Constraint | None = None  # structured outputs: its grammar's state

    def process_new_tokens(self, logprob: dict[int, float] | None) -> int | str | None:
        """Detokenize the tokens the scheduler appended since the last call and record the last one's logprob.
        -> the stop string they completed (the caller ends the request with it), else None."""
        request = self.request
        new = request.output_token_ids[self.num_seen:]
        if not new:
            return None  # aborted or preempted between schedule and update
        self.num_seen = request.num_output_tokens
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob[new[-1]]
        stopped_by_token = request.finish_reason == "stop" and isinstance(request.stop_reason, int | None)
        if stopped_by_token and not request.sampling_params.include_stop_str_in_output:
            new = new[:-1]  # eos / stop id: not part of the text
        return self.detok.add_tokens(new) if new else None

    def delta(self, prompt_logprobs: tuple[list, list] | None) -> CompletionOutput:
        """What was processed since the last output; `prompt_logprobs` (entries, ranks) when this one carries
        them."""
        r = self.request
        new_ids = r.output_token_ids[self.num_sent:self.num_seen]
        self.num_sent = self.num_seen
        logprobs = self.logprobs
        if logprobs is not None:
            self.logprobs = []
        entries, ranks = prompt_logprobs or (None, None)
        return CompletionOutput(index=self.index, text=self.detok.take_text(r.is_finished), token_ids=new_ids,
                                logprobs=logprobs, finish_reason=r.finish_reason, stop_reason=r.stop_reason,
                                cumulative_logprob=self.cumulative_logprob, prompt_logprobs=entries,
                                prompt_logprob_ranks=ranks)


@dataclass
class RequestState:
    """A request: its samples, metrics and prompt logprobs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by position (0: None); None: not asked
    prompt_logprob_ranks: list[int | None] | None = None  # the prompt tokens' ranks, by position
    prompt_logprobs_due: bool = False  # the next output with tokens carries them (once per request)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)

    def ask_prompt_logprobs(self, top_n: int, scored_prefixes: ScoredPrefixes | None, block_size: int) -> None:
        """Set up the prompt's logprobs (top_n each): those of its leading blocks scored before come from
        `scored_prefixes` (the scheduler's prefix lookup then hits them), the rest the runner scores as the prompt's
        chunks are computed."""
        n = len(self.prompt_token_ids)
        self.prompt_logprobs_due = True
        self.prompt_logprobs, self.prompt_logprob_ranks = [None] * n, [None] * n
        known = 1  # positions whose logprobs are known from the start: the first has none (no context)
        if scored_prefixes is not None:
            hashes = compute_block_hashes(self.prompt_token_ids, block_size)
            for s in self.seqs:  # the KV cache manager's prefix lookup extends these: hashed once
                s.request.block_hashes = list(hashes)
            known = max(known, scored_prefixes.fill(self.prompt_token_ids, hashes, top_n, self.prompt_logprobs,
                                                    self.prompt_logprob_ranks))
        if known < n:  # a 1-token prompt has nothing to score
            for s in self.seqs:  # any of them may compute the prompt (the leader, or one after a preemption)
                s.request.prompt_logprobs = top_n
                s.request.scored_prompt_tokens = known

    def add_scored_prompt(self, scored: PromptLogprobs) -> int | None:
        """Prompt logprobs a forward scored. Once every position is known, the
        requests stop asking the scheduler for more (a preempted one may use the prefix cache again). -> the top-n
        they were scored with when this completed them (the caller may keep them by prefix block), else None."""
        for position, (entry, rank) in enumerate(zip(scored.entries, scored.ranks, strict=True),
                                                 scored.first_position):
            self.prompt_logprobs[position], self.prompt_logprob_ranks[position] = entry, rank
        entries, lead = self.prompt_logprobs, self.seqs[0].request
        known = max(1, lead.scored_prompt_tokens)  # positions before it are known already: go on from there
        while known < len(entries) and entries[known] is not None:
            known += 1
        for s in self.seqs:
            s.request.scored_prompt_tokens = known  # a preempted one may take a hit up to there
        if known < len(entries):
            return None
        top_n = lead.prompt_logprobs
        for s in self.seqs:
            s.request.prompt_logprobs = None
        return top_n

    def delta(self, finished: bool) -> RequestOutput:
        """The request's delta: per sample, what was processed since its last output."""
        outs = []
        for s in self.seqs:
            carried = None
            if self.prompt_logprobs_due and s.num_seen > s.num_sent:
                carried, self.prompt_logprobs_due = (self.prompt_logprobs, self.prompt_logprob_ranks), False
            outs.append(s.delta(carried))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, finished,
                             dataclasses.replace(self.metrics))

    def failed(self, error: str, kind: str) -> RequestOutput:
        """The final output of a request whose own work failed: finish_reason "error" for every sample."""
        outs = [CompletionOutput(index=s.index, text="", token_ids=[], logprobs=None, finish_reason="error",
                                 cumulative_logprob=s.cumulative_logprob) for s in self.seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, True,
                             dataclasses.replace(self.metrics), error=error, error_kind=kind)
