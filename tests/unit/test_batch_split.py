"""batch_split: the CPU runner's groups of sequences (no torch)."""

import pytest

from gpu_worker.core.sched_output import ScheduledSeq
from gpu_worker.executor.batch_split import MAX_PART_SHARE, seq_cost, split_batch

pytestmark = pytest.mark.unit

BS = 4


def decode(rid: str, ctx: int, first_block: int) -> ScheduledSeq:
    """One decode token at position ctx - 1 over blocks first_block, first_block + 1, ..."""
    table = list(range(first_block, first_block + -(-ctx // BS)))
    pos = ctx - 1
    return ScheduledSeq(rid, [7], pos, table, [table[pos // BS] * BS + pos % BS], True)


def prefill(rid: str, n: int, first_block: int, sample: bool = True) -> ScheduledSeq:
    table = list(range(first_block, first_block + -(-n // BS)))
    return ScheduledSeq(rid, [1] * n, 0, table, [table[p // BS] * BS + p % BS for p in range(n)], sample)


def test_equal_decodes_split_in_halves():
    seqs = [decode(str(i), 20, 10 * i) for i in range(6)]
    parts = split_batch(seqs, 2, BS)
    assert sorted(len(p) for p in parts) == [3, 3]
    assert sorted(i for p in parts for i in p) == list(range(6)) and all(p == sorted(p) for p in parts)


def test_split_balances_cost_not_count():
    seqs = [prefill("p", 40, 0), prefill("q", 30, 12)] + [decode(str(i), 8, 30 + 4 * i) for i in range(60)]
    parts = split_batch(seqs, 2, BS)
    assert len(parts) == 2 and {0, 1} & set(parts[0]) and {0, 1} & set(parts[1])  # the prefills apart
    costs = [sum(seq_cost(seqs[i]) for i in p) for p in parts]
    assert max(costs) / sum(costs) < 0.51
    assert sorted(i for p in parts for i in p) == list(range(len(seqs)))


def test_one_group_when_it_cannot_balance_or_has_one_sequence():
    assert split_batch([decode("a", 9, 0)], 2, BS) == [[0]]
    lopsided = [prefill("big", 400, 0), decode("d", 5, 110)]
    assert seq_cost(lopsided[0]) / sum(map(seq_cost, lopsided)) > MAX_PART_SHARE
    assert len(split_batch(lopsided, 2, BS)) == 1
    assert len(split_batch([decode("a", 9, 0), decode("b", 9, 5)], 1, BS)) == 1


def test_one_group_when_a_part_reads_a_block_another_writes():
    a = decode("a", 6, 0)  # blocks 0, 1; writes slot 5 (block 1)
    b = ScheduledSeq("b", [3], 5, [0, 1], [a.slot_mapping[0]], True)  # reads (and writes) block 1
    assert len(split_batch([a, b], 2, BS)) == 1
    x = decode("x", 6, 20)  # blocks 20, 21; writes block 21
    shares_a_full_block = ScheduledSeq("c", [3], 8, [20, 30, 31], [31 * BS], True)  # reads block 20 only
    assert len(split_batch([x, shares_a_full_block], 2, BS)) == 2


def test_more_parts_than_sequences():
    seqs = [decode(str(i), 9, 5 * i) for i in range(3)]
    parts = split_batch(seqs, 8, BS)
    assert parts == [[0], [1], [2]]
