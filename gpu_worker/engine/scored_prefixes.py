"""Prompt logprobs kept by prefix block, so that a request scoring its prompt can take a prefix-cache hit.

A prefix-cache hit has no logits: the rows of the cached tokens are never computed, so their logprobs cannot
be scored (vLLM therefore turns the prefix cache off for such requests). Yet the logprob of prompt token p
depends only on tokens 0..p, so for a full block it is a function of the block's chained hash
(gpu_worker.core.kv_cache_manager), like its keys and values; and the logprob of the token just after a full
block, a function of that block's hash and that token. This cache keeps, per top N, both: each full block's
entries and ranks, and the entry of the token that followed it, from every prompt scored to the end. A new
scoring request takes the entries of its leading blocks (and of the token after them) found here, and the
scheduler may then give it a KV hit over those blocks (`Request.scored_prompt_tokens`: a hit's last row
predicts the token after it, so that entry must be known too). lm-eval's multiple choice sends each question's
context once per choice, and few-shot tasks share their examples across questions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

Entry = dict[int, float] | None

# What it holds at most, in logprobs (a token id and its logprob; an entry at top N holds N or N + 1): about 100
# bytes of Python objects each, so ~50 MB. At top N 1 (lm-eval's), ~15,000 blocks of 16.
DEFAULT_CAPACITY = 500_000


class ScoredPrefixes:
    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY):
        self.block_size = block_size
        self.capacity = capacity  # logprobs (see DEFAULT_CAPACITY)
        self.size = 0  # logprobs held
        # (block hash, top N): the block's entries; (block hash, top N, next token): the one after it
        self._blocks: OrderedDict[tuple[int, ...], tuple[tuple[Entry, ...], tuple[int | None, ...]]] = OrderedDict()
        self.hits = 0  # blocks and tokens-after found (for the tests)

    def __len__(self) -> int:
        return len(self._blocks)

    def fill(self, prompt: Sequence[int], hashes: Sequence[int], top_n: int, entries: list[Entry],
             ranks: list[int | None]) -> int:
        """Fill `entries` / `ranks` (by prompt position) from the leading blocks found, and the token after them;
        returns how many positions are known from the start."""
        bs, known = self.block_size, 0
        for b, block_hash in enumerate(hashes):
            found = self._get((block_hash, top_n))
            if found is None:
                break
            entries[b * bs:(b + 1) * bs], ranks[b * bs:(b + 1) * bs] = found
            known = (b + 1) * bs
        if known and known < len(prompt):
            edge = self._get((hashes[known // bs - 1], top_n, prompt[known]))
            if edge is not None:
                (entries[known],), (ranks[known],) = edge
                known += 1
        return known

    def keep(self, prompt: Sequence[int], hashes: Sequence[int], top_n: int, entries: list[Entry],
             ranks: list[int | None]) -> None:
        """A prompt scored to the end: keep each full block's entries and the one after it (the least recently used
        go first)."""
        if self.capacity <= 0:
            return
        bs = self.block_size
        for b, block_hash in enumerate(hashes):
            self._put((block_hash, top_n), entries[b * bs:(b + 1) * bs], ranks[b * bs:(b + 1) * bs])
            after = (b + 1) * bs
            if after < len(prompt):
                self._put((block_hash, top_n, prompt[after]), entries[after:after + 1], ranks[after:after + 1])
        while self.size > self.capacity:
            _, (entries, _) = self._blocks.popitem(last=False)
            self.size -= _size(entries)

    def _get(self, key: tuple[int, ...]) -> tuple[tuple[Entry, ...], tuple[int | None, ...]] | None:
        found = self._blocks.get(key)
        if found is not None:
            self._blocks.move_to_end(key)
            self.hits += 1
        return found

    def _put(self, key: tuple[int, ...], entries: list[Entry], ranks: list[int | None]) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)
        else:
            self._blocks[key] = (tuple(entries), tuple(ranks))
            self.size += _size(entries)


def _size(entries: Sequence[Entry]) -> int:
    return sum(len(e) for e in entries if e is not None) or 1
