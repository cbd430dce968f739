"""Tensor parallelism's arithmetic: the checks that refuse a split, which KV head each rank holds, the vocabulary
shards, the CPU shares, and the step that travels to the executors as ints (it must come back equal)."""

import pytest

from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.executor.tp_group import check_divisible, first_kv_head, local_kv_heads, vocab_shard
from gpu_worker.executor.tp_runner import decode_step, encode_step, split_cpus

pytestmark = pytest.mark.unit


def test_check_divisible_names_what_does_not_split():
    check_divisible(num_heads=32, num_kv_heads=8, intermediate_size=14336, size=4)
    check_divisible(num_heads=32, num_kv_heads=2, intermediate_size=128, size=8)  # KV heads replicated
    with pytest.raises(ValueError, match="must divide the model's 9 attention heads"):
        check_divisible(num_heads=9, num_kv_heads=3, intermediate_size=1536, size=2)
    with pytest.raises(ValueError, match="must divide the model's 6 KV heads, or be a multiple"):
        check_divisible(num_heads=12, num_kv_heads=6, intermediate_size=1536, size=4)
    with pytest.raises(ValueError, match="MLP size 102"):
        check_divisible(num_heads=8, num_kv_heads=2, intermediate_size=102, size=4)
    with pytest.raises(ValueError, match=">= 1"):
        check_divisible(num_heads=4, num_kv_heads=2, intermediate_size=128, size=0)


def test_kv_heads_split_or_replicated():
    # 8 KV heads over 4 ranks: 2 each, consecutive
    assert [local_kv_heads(8, 4)] * 4 == [2, 2, 2, 2]
    assert [first_kv_head(8, r, 4) for r in range(4)] == [0, 2, 4, 6]
    # 2 KV heads over 8 ranks (32 query heads, 4 per rank, 16 per KV head): ranks 0-3 read head 0, 4-7 head 1
    assert local_kv_heads(2, 8) == 1
    assert [first_kv_head(2, r, 8) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for r in range(8):  # the KV head a rank holds is the one its query heads [4r, 4r + 4) read
        assert {q // 16 for q in range(4 * r, 4 * r + 4)} == {first_kv_head(2, r, 8)}


def test_vocab_shards_cover_the_vocabulary_once():
    for vocab, size in [(49152, 2), (49152, 3), (32001, 4), (5, 8)]:
        rows = []
        for r in range(size):
            first, held, shard = vocab_shard(vocab, r, size)
            assert shard == -(-vocab // size) and 0 <= held <= shard
            rows += range(first, first + held)
        assert rows == list(range(vocab))


def test_split_cpus():
    assert split_cpus([0, 1, 2, 3, 4, 5], 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_cpus([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7]]
    assert split_cpus([0, 1], 3) == []  # fewer CPUs than ranks: not bound


def test_step_round_trips_as_ints():
    sched = SchedulerOutput(seqs=[ScheduledSeq("a", [5, 6, 7], 0, [3, 9], [48, 49, 50], False),
                                  ScheduledSeq("b", [11], 40, [1, 2, 4], [70], True),
                                  ScheduledSeq("c", [], 0, [], [], True),
                                  ScheduledSeq("d", [4, 5, 6], 2, [7], [28, 29, 30], False, [5, 6, 9], 4)],
                            blocks_to_copy=[(3, 8), (2, 5)])
    back = decode_step(encode_step(sched))
    assert back.blocks_to_copy == sched.blocks_to_copy

    def fields(s):
        return (s.token_ids, s.start_pos, s.block_table, s.slot_mapping, s.sample, s.prompt_logprob_targets,
                s.num_prompt_logprobs)

    assert [fields(s) for s in back.seqs] == [fields(s) for s in sched.seqs]
    assert decode_step(encode_step(SchedulerOutput())).seqs == []
