"""Scheduler: batching, chunked prefill, policies, preemption, groups, stop rules, rejection (exact ids)."""

import logging

import pytest

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.request import Request, RequestStatus
from gpu_worker.core.scheduler import RequestRejected, Scheduler
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, policy="fcfs",
         caching=True, clock=None, **kw):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                        policy=policy, **kw),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        clock=clock or Clock(),
    )


def req(rid, prompt, max_tokens=4, arrival=0.0, priority=0, eos=None, output_token_ids=(), **sp):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sp), eos_token_id=eos,
                   priority=priority, arrival_time=arrival, output_token_ids=list(output_token_ids))


def step(s, token=7):
    out = s.schedule()
    finished = s.update_from_output(out, {q.request_id: token for q in out.seqs if q.sample})
    return out, finished


def preempted(s):
    """Ids of the waiting requests that were preempted and have not run again yet."""
    return [r.request_id for r in s.waiting if r.status == RequestStatus.PREEMPTED]


def test_prefill_then_decode_exact_blocks_and_slots():
    s = make()
    s.add_request(req("a", range(6), max_tokens=3))
    out, _ = step(s)
    (q,) = out.seqs
    assert (q.token_ids, q.start_pos, q.block_table, q.sample) == ([0, 1, 2, 3, 4, 5], 0, [0, 1], True)
    assert q.slot_mapping == [0, 1, 2, 3, 4, 5]
    out, _ = step(s, token=8)
    (q,) = out.seqs
    assert (q.token_ids, q.start_pos, q.block_table, q.slot_mapping, q.sample) == ([7], 6, [0, 1], [6], True)
    out, finished = step(s, token=9)
    (q,) = out.seqs
    assert (q.token_ids, q.start_pos, q.block_table, q.slot_mapping) == ([8], 7, [0, 1], [7])
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].output_token_ids == [7, 8, 9] and finished[0].finish_reason == "length"
    assert finished[0].status == RequestStatus.FINISHED_LENGTH
    assert not s.has_unfinished_requests() and s.get_request("a") is None
    assert s.stats().used_blocks == 0
    assert s.schedule().is_empty


def test_chunked_prefill_splits_a_long_prompt():
    s = make(budget=4)
    s.add_request(req("a", range(10), max_tokens=2))
    chunks = [step(s)[0].seqs[0] for _ in range(3)]
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in chunks] == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert [c.block_table for c in chunks] == [[0], [0, 1], [0, 1, 2]]
    assert chunks[2].slot_mapping == [8, 9]
    assert s.get_request("a").output_token_ids == [7]


def test_token_budget_shared_by_decode_and_prefill():
    s = make(budget=5)
    s.add_request(req("a", range(3), max_tokens=5))
    step(s)
    s.add_request(req("b", range(10), max_tokens=2))
    out, _ = step(s)
    assert [(q.request_id, len(q.token_ids)) for q in out.seqs] == [("a", 1), ("b", 4)]
    assert out.num_batched_tokens == 5


def test_max_num_seqs_cap():
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add_request(req(f"r{i}", range(3), max_tokens=2, arrival=i))
    while s.has_unfinished_requests():
        out, _ = step(s)
        assert len(out.seqs) <= 2 and len(s.running) <= 2


def test_fcfs_admits_in_arrival_order():
    s = make(max_num_seqs=1)
    for rid in ["x", "y", "z"]:
        s.add_request(req(rid, range(3), max_tokens=1))
    order = [step(s)[0].seqs[0].request_id for _ in range(3)]
    assert order == ["x", "y", "z"]


def test_priority_lower_value_first_arrival_breaks_ties():
    s = make(max_num_seqs=1, policy="priority")
    s.add_request(req("late-low", range(3), max_tokens=1, arrival=1, priority=5))
    s.add_request(req("late-high", range(3), max_tokens=1, arrival=2, priority=0))
    s.add_request(req("early-high", range(3), max_tokens=1, arrival=0, priority=0))
    order = [step(s)[0].seqs[0].request_id for _ in range(3)]
    assert order == ["early-high", "late-high", "late-low"]


def test_sjf_shortest_first_with_aging():
    clock = Clock()
    s = make(max_num_seqs=1, policy="sjf", clock=clock, sjf_aging_s=10.0, budget=64, num_blocks=32, max_model_len=128)
    s.add_request(req("long", range(40), max_tokens=1, arrival=0.0))
    s.add_request(req("short", range(4), max_tokens=1, arrival=0.0))
    assert step(s)[0].seqs[0].request_id == "short"
    assert step(s)[0].seqs[0].request_id == "long"
    # aging: a long prompt that waited gains block_size (4) tokens of shortness per 10 s
    clock.now = 100.0  # "old" has waited 100 s: 40 - 40 = 0 beats a fresh 4-token prompt
    s.add_request(req("old", range(40), max_tokens=1, arrival=0.0))
    s.add_request(req("fresh", range(4), max_tokens=1, arrival=100.0))
    assert step(s)[0].seqs[0].request_id == "old"
    clock.now = 50.0
    s2 = make(max_num_seqs=1, policy="sjf", clock=clock, sjf_aging_s=10.0, num_blocks=32, max_model_len=128)
    s2.add_request(req("old", range(40), max_tokens=1, arrival=0.0))  # 40 - 20 = 20 > 4
    s2.add_request(req("fresh", range(4), max_tokens=1, arrival=50.0))
    assert step(s2)[0].seqs[0].request_id == "fresh"


def test_preemption_by_recompute_goes_to_front_and_resumes():
    s = make(num_blocks=4, max_model_len=32)
    s.add_request(req("a", range(6), max_tokens=8, arrival=0))  # blocks 0, 1
    s.add_request(req("b", range(100, 106), max_tokens=8, arrival=1))  # blocks 2, 3
    s.add_request(req("c", range(200, 203), max_tokens=1, arrival=2))
    out, _ = step(s)
    assert [q.block_table for q in out.seqs] == [[0, 1], [2, 3]]
    step(s)  # a, b: position 6 -> slots 6 and 14
    step(s)  # position 7 -> slots 7 and 15: both blocks full
    out, _ = step(s)  # a needs a third block, none is free -> b (latest arrival) is preempted
    assert preempted(s) == ["b"]
    assert [(q.request_id, q.block_table) for q in out.seqs] == [("a", [0, 1, 3])]
    b = s.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["b", "c"] and b.arrival_time == 1
    assert s.stats().num_preemptions == 1
    while s.get_request("a"):
        step(s)
    out, _ = step(s)  # b comes back first and recomputes its prompt and its three outputs
    q = out.seqs[0]
    assert (q.request_id, q.start_pos, q.sample) == ("b", 0, True)
    assert q.token_ids == [100, 101, 102, 103, 104, 105, 7, 7, 7]


def test_preemption_victim_is_lowest_priority_even_if_earlier():
    s = make(num_blocks=4, max_model_len=32, policy="priority")
    s.add_request(req("low", range(6), max_tokens=8, arrival=0, priority=9))
    s.add_request(req("high", range(100, 106), max_tokens=8, arrival=1, priority=0))
    for _ in range(3):
        step(s)
    out, _ = step(s)
    assert preempted(s) == ["low"] and s.stats().num_preemptions == 1
    assert s.get_request("low").priority == 9 and s.get_request("low").arrival_time == 0


def test_request_preempts_itself_when_it_is_the_victim():
    s = make(num_blocks=4, max_model_len=32)
    s.add_request(req("a", range(6), max_tokens=8, arrival=0))
    s.add_request(req("b", range(100, 106), max_tokens=8, arrival=1))
    for _ in range(3):
        step(s)
    s.running.reverse()  # b is visited first: it is the latest arrival, so it gives up its own blocks
    out, _ = step(s)
    assert preempted(s) == ["b"] and s.stats().num_preemptions == 1 and [q.request_id for q in out.seqs] == ["a"]


def test_rejections_name_the_numbers():
    s = make(num_blocks=4, max_model_len=32)
    with pytest.raises(RequestRejected, match=r"prompt is 30 tokens \+ max_tokens 8 = 38 > max_model_len 32"):
        s.add_request(req("a", range(30), max_tokens=8))
    with pytest.raises(RequestRejected, match=r"prompt is 32 tokens >= max_model_len 32"):
        s.add_request(req("b", range(32), max_tokens=None))
    with pytest.raises(RequestRejected, match=r"needs 5 blocks \(17 tokens / block_size 4\), the cache has 4"):
        s.add_request(req("c", range(17), max_tokens=1))
    with pytest.raises(RequestRejected, match="empty"):
        s.add_request(req("d", [], max_tokens=1))
    s.add_request(req("e", range(3)))
    with pytest.raises(RequestRejected, match="already scheduled"):
        s.add_request(req("e", range(3)))
    assert [r.request_id for r in s.waiting] == ["e"] and s.stats().num_waiting == 1


def test_request_outgrowing_the_whole_cache_finishes_with_length():
    s = make(num_blocks=2, max_model_len=64)
    s.add_request(req("a", range(6), max_tokens=20))
    finished = []
    for _ in range(5):
        finished += step(s)[1]
    (a,) = finished
    assert a.finish_reason == "length" and a.num_tokens == 9 and a.num_preemptions == 0
    assert not s.has_unfinished_requests() and s.stats().free_blocks == 2


def test_stop_rules_eos_min_tokens_ignore_eos_stop_token_ids():
    s = make()
    s.add_request(req("eos", range(3), max_tokens=5, eos=7))
    s.add_request(req("min", range(3), max_tokens=5, eos=7, min_tokens=2))
    s.add_request(req("ign", range(3), max_tokens=3, eos=7, ignore_eos=True))
    s.add_request(req("stop", range(3), max_tokens=5, stop_token_ids=[7]))
    done = {}
    while s.has_unfinished_requests():
        for r in step(s, token=7)[1]:
            done[r.request_id] = r
    assert (done["eos"].finish_reason, done["eos"].stop_reason, done["eos"].num_output_tokens) == ("stop", None, 1)
    assert (done["min"].finish_reason, done["min"].num_output_tokens) == ("stop", 2)
    assert (done["ign"].finish_reason, done["ign"].num_output_tokens) == ("length", 3)
    assert (done["stop"].finish_reason, done["stop"].stop_reason) == ("stop", 7)
    assert done["stop"].status == RequestStatus.FINISHED_STOPPED


def test_finish_request_and_abort_free_blocks():
    s = make()
    s.add_request(req("a", range(6), max_tokens=8))
    s.add_request(req("w", range(6), max_tokens=8))
    step(s)
    a, w = s.get_request("a"), s.get_request("w")
    s.finish_request("a", "stop", stop_reason="\n\n")
    assert (a.status, a.stop_reason, s.get_request("a")) == (RequestStatus.FINISHED_STOPPED, "\n\n", None)
    a_done = s.schedule()
    assert [q.request_id for q in a_done.seqs] == ["w"]
    s.abort_request("w")
    s.abort_request("w")  # finished: no-op
    s.abort_request("nope")  # unknown: no-op
    assert w.status == RequestStatus.FINISHED_ABORTED and w.finish_reason == "abort"
    assert not s.has_unfinished_requests() and s.stats().used_blocks == 0
    assert s.schedule().is_empty


def test_prefix_hit_at_admission_sets_computed_tokens():
    s = make()
    s.add_request(req("a", range(10), max_tokens=1))
    step(s)  # finishes; its blocks 0, 1 stay cached
    s.add_request(req("b", [*range(8), 42, 43], max_tokens=1))
    out, _ = step(s)
    (q,) = out.seqs
    assert (q.start_pos, q.token_ids, q.block_table[:2]) == (8, [42, 43], [0, 1])
    st = s.stats()
    assert st.prefix_cache_hits == 8 and st.prefix_cache_queries == 20 and st.cached_blocks == 2


def test_identical_prompt_recomputes_its_last_token():
    s = make()
    s.add_request(req("a", range(8), max_tokens=1))
    step(s)
    s.add_request(req("b", range(8), max_tokens=1))
    out, finished = step(s)
    (q,) = out.seqs
    assert (q.start_pos, q.token_ids, q.block_table, q.sample) == (4, [4, 5, 6, 7], [0, 2], True)
    assert [r.request_id for r in finished] == ["b"] and finished[0].num_cached_tokens == 4


def test_group_forks_after_prompt_minus_one_and_copies_on_write():
    s = make()
    s.add_request_group([req(f"g{i}", range(6), max_tokens=2, seed=i) for i in range(3)])
    assert s.stats().num_waiting == 3
    out, _ = step(s)
    (q,) = out.seqs  # the leader computes the shared prefix, samples nothing
    assert (q.request_id, q.token_ids, q.block_table, q.sample) == ("g0", [0, 1, 2, 3, 4], [0, 1], False)
    out, _ = step(s)  # siblings fork, each computes the last prompt token; shared block 1 is copied
    assert [(q.request_id, q.start_pos, q.token_ids, q.block_table, q.sample) for q in out.seqs] == [
        ("g0", 5, [5], [0, 2], True),
        ("g1", 5, [5], [0, 3], True),
        ("g2", 5, [5], [0, 1], True),
    ]
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    refs = [b.ref_cnt for b in s.kv_cache_manager.block_pool.blocks[:4]]
    assert refs == [3, 1, 1, 1]
    while s.has_unfinished_requests():
        step(s)
    assert s.stats().used_blocks == 0


def test_group_with_a_prompt_shorter_than_a_block_writes_each_last_token_into_its_own_block():
    s = make()
    s.add_request_group([req(f"g{i}", [10, 11, 12], max_tokens=2) for i in range(2)])
    out, _ = step(s)
    assert [(q.request_id, q.token_ids, q.block_table, q.slot_mapping, q.sample) for q in out.seqs] == [
        ("g0", [10, 11], [0], [0, 1], False)]
    out, _ = step(s)  # the leader writes into the copy of block 0 (made before the forward), g1 into block 0
    assert [(q.request_id, q.start_pos, q.token_ids, q.block_table, q.slot_mapping) for q in out.seqs] == [
        ("g0", 2, [12], [1], [6]),
        ("g1", 2, [12], [0], [2]),
    ]
    assert out.blocks_to_copy == [(0, 1)]
    out, _ = step(s, token=8)
    assert [(q.request_id, q.token_ids, q.block_table, q.slot_mapping) for q in out.seqs] == [
        ("g0", [7], [1], [7]), ("g1", [7], [0], [3])]
    assert out.blocks_to_copy == []
    assert not s.has_unfinished_requests() and s.stats().used_blocks == 0


def test_resumed_group_recomputes_outputs_and_stops_its_hit_at_the_shared_prefix():
    s = make()
    s.add_request(req("a", [*range(8), 1, 2, 3, 4, 5], max_tokens=1))
    step(s)  # caches blocks [0..3], [4..7], [8, 1, 2, 3]
    s.add_request_group([
        req("g0", range(8), max_tokens=8, output_token_ids=[1, 2, 3, 4]),
        req("g1", range(8), max_tokens=8, output_token_ids=[9]),
    ])
    out, _ = step(s)  # the leader's hit could reach 12 tokens; it stops at the 4-token boundary below 7
    (q,) = out.seqs
    assert (q.request_id, q.start_pos, q.token_ids, q.sample) == ("g0", 4, [4, 5, 6], False)
    out, _ = step(s)
    assert [(q.request_id, q.start_pos, q.token_ids, q.sample) for q in out.seqs] == [
        ("g0", 7, [7, 1, 2, 3, 4], True),
        ("g1", 7, [7, 9], True),
    ]
    assert len(out.blocks_to_copy) == 1


def test_resumed_request_that_already_ended_is_reported_without_running():
    s = make()
    s.add_request(req("done", range(4), max_tokens=2, output_token_ids=[5, 6]))
    s.add_request_group([req("g0", range(4), max_tokens=2, eos=9, output_token_ids=[9]),
                         req("g1", range(4), max_tokens=2, eos=9, output_token_ids=[1])])
    assert [r.request_id for r in s.waiting] == ["g1"]
    out, finished = step(s)
    assert [q.request_id for q in out.seqs] == ["g1"]
    assert [(r.request_id, r.finish_reason) for r in finished] == [("done", "length"), ("g0", "stop"), ("g1", "length")]


def test_group_with_one_token_prompt_needs_no_fork():
    s = make()
    s.add_request_group([req(f"g{i}", [5], max_tokens=1) for i in range(2)])
    out, _ = step(s)
    assert [(q.request_id, q.block_table) for q in out.seqs] == [("g0", [0]), ("g1", [1])]
    assert out.blocks_to_copy == []


def test_group_leader_aborted_before_fork_releases_siblings():
    s = make(budget=2)
    s.add_request_group([req(f"g{i}", range(6), max_tokens=2) for i in range(2)])
    step(s)
    s.abort_request("g0")
    assert [r.request_id for r in s.waiting] == ["g1"]
    while s.has_unfinished_requests():
        step(s)
    with pytest.raises(RequestRejected, match="n=9 sequences > max_num_seqs 8"):
        s.add_request_group([req(f"h{i}", range(6)) for i in range(9)])


def test_memory_log(caplog):
    clock = Clock()
    s = make(clock=clock, log_memory_usage_s=5.0)
    s.add_request(req("a", range(6), max_tokens=8))
    with caplog.at_level(logging.INFO, logger="kvfleet.scheduler"):
        step(s)
        assert not caplog.records
        clock.now = 6.0
        step(s)
    (rec,) = caplog.records
    assert "2/16 blocks used" in rec.getMessage() and "fragmentation 2 of 8 slots" in rec.getMessage()
    assert "0 preemptions" in rec.getMessage()


def test_prompt_logprobs_name_each_chunks_targets_and_hit_the_cache_only_where_scored():
    """A request scoring its prompt computes every position whose logprob is not known yet (a cached prefix has no
    logits): the prefix-cache hit stops where scored_prompt_tokens (positions known from the start, set by the
    engine from gpu_worker.engine.scored_prefixes) stops; each chunk names the prompt tokens its rows predict;
    once the engine has them all (it clears the field), hits count in full again."""
    s = make(budget=6, block_size=4)
    prompt = list(range(100, 113))  # 13 tokens
    warm = req("warm", prompt, max_tokens=1)
    s.add_request(warm)
    while s.has_unfinished_requests():
        step(s)

    def chunks_of(request):
        s.add_request(request)
        chunks = []
        while not request.output_token_ids:
            out = s.schedule()
            (seq,) = out.seqs
            chunks.append((seq.start_pos, seq.prompt_logprob_targets, seq.num_prompt_logprobs))
            s.update_from_output(out, {seq.request_id: 7} if seq.sample else {})
        return chunks

    scoring = req("a", prompt, max_tokens=1)
    scoring.prompt_logprobs, scoring.scored_prompt_tokens = 2, 1  # nothing known but position 0 (no context)
    assert chunks_of(scoring) == [(0, prompt[1:7], 2), (6, prompt[7:13], 2), (12, [], 2)]  # the last predicts none
    assert scoring.num_cached_tokens == 0
    partly = req("p", prompt, max_tokens=1)
    partly.prompt_logprobs, partly.scored_prompt_tokens = 2, 9  # positions 0-8 known: a hit of 2 blocks
    assert chunks_of(partly) == [(8, prompt[9:13], 2)] and partly.num_cached_tokens == 8
    whole = req("w", prompt, max_tokens=1)
    whole.prompt_logprobs, whole.scored_prompt_tokens = 2, 8  # position 8 is not known: row 7 must be computed
    assert chunks_of(whole)[0] == (4, prompt[5:11], 2) and whole.num_cached_tokens == 4
    again = req("b", prompt, max_tokens=1)
    again.prompt_logprobs = None
    s.add_request(again)
    out = s.schedule()
    assert again.num_cached_tokens == 12 and out.seqs[0].prompt_logprob_targets == []
