"""What the scheduler decided for one engine step: the only thing the model runner is told.

Ints and ids only (no torch): the scheduler builds it, the model runner turns it into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledSeq:
    """One sequence's work in this step: a prefill chunk or one decode token."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step (a prompt chunk, or the last sampled token)
    start_pos: int  # position of token_ids[0] == the request's num_computed_tokens before the step
    block_table: list[int]  # physical block ids covering positions [0, start_pos + len(token_ids))
    slot_mapping: list[int]  # one per token in token_ids: block_id * block_size + offset
    sample: bool  # True when this chunk reaches the end of the known tokens: sample a new token
    # Prompt logprobs: the prompt tokens that token_ids[0], token_ids[1], ... predict (the next ones), for as
    # many of this chunk's leading tokens as predict a prompt token; empty: none wanted. With the top N of each.
    prompt_logprob_targets: list[int] = field(default_factory=list)
    num_prompt_logprobs: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens whose keys/values attention reads after this step's are stored."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's work: the sequences to run, in batch order, and the block copies to make first."""

    seqs: list[ScheduledSeq] = field(default_factory=list)  # batch order: the runner keeps it
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
