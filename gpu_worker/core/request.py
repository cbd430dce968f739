"""A request as the scheduler tracks it: token counters, not phases.

`num_computed_tokens` against `num_tokens` says everything: prefill (chunked or not), prefix-cache hits
(computed tokens start at the hit) and preemption by recompute (back to 0) all share one path.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)

FINISH_REASON_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0  # lower runs first under the "priority" policy
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)  # may hold tokens sent before a worker crash
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    max_model_len: int | None = None  # set by the scheduler on add when left None
    num_cached_tokens: int = 0  # prefix-cache hit (tokens) at first admission
    block_hashes: list[int] = field(default_factory=list, repr=False)  # chained hashes of its full blocks
    # Set by the engine while the prompt's logprobs are still to compute: top N of them. The scheduler then
    # names each chunk's targets, and takes a prefix-cache hit (which has no logits) only over positions whose
    # logprobs are known already: the first scored_prompt_tokens (gpu_worker.engine.scored_prefixes).
    prompt_logprobs: int | None = None
    scored_prompt_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed: sampling_params.max_tokens, or what the context window leaves."""
        if self.sampling_params.max_tokens is not None:
            return self.sampling_params.max_tokens
        if self.max_model_len is None:
            raise ValueError(f"request {self.request_id}: max_tokens is None and max_model_len is unknown")
        return self.max_model_len - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a token was appended: set status/finish_reason/stop_reason if the request is done."""
        sp = self.sampling_params
        last = self.output_token_ids[-1] if self.output_token_ids else None
        if last is not None and self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id:
                self.finish("stop")
                return True
            if last in sp.stop_token_ids:
                self.finish("stop", stop_reason=last)
                return True
        too_long = self.max_model_len is not None and self.num_tokens >= self.max_model_len
        if self.num_output_tokens >= self.max_tokens or too_long:
            self.finish("length")
            return True
        return False

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if reason not in FINISH_REASON_STATUS:
            raise ValueError(f"finish reason must be one of {sorted(FINISH_REASON_STATUS)}, got {reason!r}")
        self.status = FINISH_REASON_STATUS[reason]
        self.finish_reason = reason
        self.stop_reason = stop_reason
