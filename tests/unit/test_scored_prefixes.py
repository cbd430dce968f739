"""ScoredPrefixes (gpu_worker.engine.scored_prefixes): prompt logprobs kept per full block and per token after
one, found again only for the same prefix, the same next token and the same top N; the least recently used go."""

from __future__ import annotations

import pytest

from gpu_worker.core.kv_cache_manager import compute_block_hashes
from gpu_worker.engine.scored_prefixes import ScoredPrefixes

pytestmark = pytest.mark.unit


def scored(prompt):
    """Made-up entries: position p's token with logprob -p, rank p (position 0: None)."""
    return [None] + [{t: -float(p)} for p, t in enumerate(prompt) if p], [None] + list(range(1, len(prompt)))


def fill(cache, prompt, top_n=1):
    entries, ranks = [None] * len(prompt), [None] * len(prompt)
    known = cache.fill(prompt, compute_block_hashes(prompt, 4), top_n, entries, ranks)
    return known, entries, ranks


def test_leading_blocks_and_the_token_after_them_come_back_for_the_same_prefix_only():
    cache = ScoredPrefixes(block_size=4)
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks
    cache.keep(prompt, compute_block_hashes(prompt, 4), 1, *scored(prompt))
    known, entries, ranks = fill(cache, prompt[:8] + [99, 98])
    assert known == 8 and entries[:8] == scored(prompt)[0][:8] and ranks[:8] == scored(prompt)[1][:8]
    known, entries, _ = fill(cache, prompt[:9] + [97])  # the same token after block 1: known too
    assert known == 9 and entries[8] == {18: -8.0} and entries[9] is None
    assert fill(cache, [0] + prompt[1:])[0] == 0  # another first block: another prefix entirely
    assert fill(cache, prompt[:4] + [55, 56, 57, 58])[0] == 4  # block 1 differs: block 0 only (55 never followed)
    assert fill(cache, prompt, top_n=2)[0] == 0  # another top N: other entries


def test_the_least_recently_used_entries_go_first():
    a, b = list(range(100, 109)), list(range(200, 209))  # 2 blocks + the token after each: 4 entries apiece,
    cache = ScoredPrefixes(block_size=4, capacity=10)  # holding 3 + 4 + 1 + 1 = 9 logprobs
    cache.keep(a, compute_block_hashes(a, 4), 1, *scored(a))
    assert (len(cache), cache.size) == (4, 9) and fill(cache, a)[0] == 9
    cache.keep(b, compute_block_hashes(b, 4), 1, *scored(b))
    # a's oldest go until 10 are left: its blocks, not the token after its last block (1 logprob)
    assert (len(cache), cache.size) == (5, 10) and fill(cache, a)[0] == 0 and fill(cache, b)[0] == 9
    off = ScoredPrefixes(block_size=4, capacity=0)
    off.keep(a, compute_block_hashes(a, 4), 1, *scored(a))
    assert len(off) == 0 and fill(off, a)[0] == 0
