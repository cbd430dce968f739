"""Split one step's batch into parts that run concurrently, one CPU core each (no torch).

On CPU the model runner runs a step as P independent forwards over groups of sequences, each on one thread
with single-threaded ops, rather than one forward whose every op is split across P threads: no OpenMP
barrier per op (on cores shared with other processes a barrier can cost milliseconds), and one part's
memory-bound attention overlaps another part's compute-bound matmuls. A sequence attends only to its own
blocks, so parts are independent as long as no block written this step is read by another part (the KV
cache manager's copy-on-write and full-block-only prefix sharing guarantee it; `split_batch` checks).
"""

from __future__ import annotations

from gpu_worker.core.sched_output import ScheduledSeq

# Relative cost of a sequence's work in a step, in units of one token's matmuls (measured on a 2-core Zen 4
# with SmolLM2-135M, `kvfleet bench throughput --profile-ops`: a decode token's matmuls 3.3 ms, a context token
# read by decode attention 3.4 us, a prefill (query, key) pair 1.1 us against 2.2 ms per prefill token's
# matmuls; only the ratios matter for balancing).
SAMPLE_COST = 0.27  # lm_head for a sampling sequence
DECODE_KEY_COST = 0.001  # one context token read by a decode query (memory-bound)
PREFILL_PAIR_COST = 0.0005  # one (query, key) pair of a prefill chunk (compute-bound)
MAX_PART_SHARE = 0.8  # 2 parts: when the costliest holds more of the work, one multi-threaded forward wins


def seq_cost(seq: ScheduledSeq) -> float:
    n, ctx = len(seq.token_ids), seq.context_len
    attention = DECODE_KEY_COST * ctx if n == 1 else PREFILL_PAIR_COST * n * (ctx - n / 2)
    return n + attention + (SAMPLE_COST if seq.sample else 0.0)


def _crosses(parts: list[list[int]], seqs: list[ScheduledSeq], block_size: int) -> bool:
    """Does a block written in one part appear in another part's block tables?"""
    tables = [{b for i in part for b in seqs[i].block_table} for part in parts]
    for p, part in enumerate(parts):
        written = {slot // block_size for i in part for slot in seqs[i].slot_mapping if slot >= 0}
        if any(written & t for q, t in enumerate(tables) if q != p):
            return True
    return False


def split_batch(seqs: list[ScheduledSeq], num_parts: int, block_size: int) -> list[list[int]]:
    """Groups of indices into `seqs` (each ascending) with about equal cost: the costliest sequence first,
    each to the cheapest group so far. One group when there is one sequence, when the costliest group would
    hold more than MAX_PART_SHARE * 2 / num_parts of the work, or when a group could read a block another
    group writes."""
    num_parts = min(num_parts, len(seqs))
    everything = [list(range(len(seqs)))]
    if num_parts <= 1:
        return everything
    costs = [seq_cost(s) for s in seqs]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0.0] * num_parts
    for i in sorted(range(len(seqs)), key=lambda i: -costs[i]):
        p = min(range(num_parts), key=loads.__getitem__)
        parts[p].append(i)
        loads[p] += costs[i]
    if max(loads) > MAX_PART_SHARE * 2 / num_parts * sum(loads):
        return everything
    parts = [sorted(part) for part in parts if part]
    parts.sort(key=lambda part: part[0])
    if _crosses(parts, seqs, block_size):
        return everything
    return parts
