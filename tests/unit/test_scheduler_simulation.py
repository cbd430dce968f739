"""Scheduler + KV cache under random load: invariants (hypothesis) and a 200-request simulation.

A fake paged KV cache checks the block tables end to end: every slot stores a hash of the token prefix
that produced it, copy-on-write pairs are applied before the "forward", and every scheduled sequence
must find the right prefix hash at every position it attends to.
"""

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.request import Request, RequestStatus
from gpu_worker.core.scheduler import Scheduler
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4
EOS = 0


class FakeModel:
    """Stands in for the runner: a KV cache of prefix hashes, written and read through the block tables."""

    def __init__(self, num_blocks: int, rng: random.Random):
        self.kv: list[int | None] = [None] * (num_blocks * BS)
        self.rng = rng

    def step(self, s: Scheduler) -> list[Request]:
        out = s.schedule()
        for src, dst in out.blocks_to_copy:
            self.kv[dst * BS : (dst + 1) * BS] = self.kv[src * BS : (src + 1) * BS]
        prefix_hashes = {}
        for q in out.seqs:
            r = s.get_request(q.request_id)
            assert r.status == RequestStatus.RUNNING
            assert len(q.block_table) == -(-q.context_len // BS)
            assert q.token_ids == r.all_token_ids[q.start_pos : q.context_len]
            h, hashes = 0, []
            for tok in r.all_token_ids[: q.context_len]:
                h = hash((h, tok))
                hashes.append(h)
            prefix_hashes[q.request_id] = hashes
            for i, slot in enumerate(q.slot_mapping):
                pos = q.start_pos + i
                assert slot == q.block_table[pos // BS] * BS + pos % BS
                self.kv[slot] = hashes[pos]
        for q in out.seqs:  # attention reads every earlier position through the block table
            hashes = prefix_hashes[q.request_id]
            for pos in range(q.context_len):
                assert self.kv[q.block_table[pos // BS] * BS + pos % BS] == hashes[pos], (q.request_id, pos)
        sampled = {q.request_id: self.rng.choice([EOS, *range(1, 6)]) for q in out.seqs if q.sample}
        return s.update_from_output(out, sampled)


def check_invariants(s: Scheduler) -> None:
    kvm = s.kv_cache_manager
    pool = kvm.block_pool
    pool.check_invariants()  # free queue == exactly the blocks with ref 0, hash map consistent
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    holders = Counter(b.block_id for blocks in kvm.req_to_blocks.values() for b in blocks)
    for blocks in kvm.req_to_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a table holds a block twice"
    for b in pool.blocks:
        assert b.ref_cnt == holders[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != {holders[b.block_id]}"
    running = {r.request_id for r in s.running}
    waiting = {r.request_id for r in s.waiting}
    assert len(running) == len(s.running) and len(waiting) == len(s.waiting) and not running & waiting
    assert set(kvm.req_to_blocks) == running
    assert running | waiting <= set(s.requests)
    for r in s.running:
        assert len(kvm.req_to_blocks[r.request_id]) == -(-r.num_computed_tokens // BS)
        assert r.num_computed_tokens <= r.num_tokens
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    st_ = s.stats()
    assert st_.used_blocks + st_.free_blocks == st_.total_blocks
    assert 0 <= st_.fragmentation_slots <= st_.allocated_slots


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("group"), st.integers(1, 10), st.integers(1, 6), st.integers(2, 3)),
    st.tuples(st.just("again"), st.integers(0, 50), st.integers(1, 6), st.integers(0, 1)),
    st.tuples(st.just("resume"), st.integers(0, 50), st.integers(4, 8), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.just(0), st.just(0)),
    st.tuples(st.just("preempt"), st.integers(0, 50), st.just(0), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(op, max_size=40),
    policy=st.sampled_from(["fcfs", "priority", "sjf"]),
    num_blocks=st.integers(8, 16),
    budget=st.sampled_from([3, 8, 64]),
    caching=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_operations_never_leak_or_double_free_blocks(ops, policy, num_blocks, budget, caching, seed):
    rng = random.Random(seed)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=40, policy=policy),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=caching),
    )
    model = FakeModel(num_blocks, rng)
    n, prompts = 0, []
    for kind, a, b, c in ops:
        n += 1
        if kind == "again" and prompts:  # a prompt seen before (+ maybe one token): prefix-cache hits
            prompt = prompts[a % len(prompts)] + [1] * c
            s.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=b), eos_token_id=EOS))
        elif kind == "resume" and prompts:  # requests taken over from a dead worker: outputs recomputed
            prompt = prompts[a % len(prompts)]
            s.add_request_group([Request(f"g{n}.{i}", prompt, SamplingParams(max_tokens=b), eos_token_id=EOS,
                                         output_token_ids=[rng.randrange(1, 4) for _ in range(rng.randint(0, 3))])
                                 for i in range(c)])
        elif kind == "add":
            prompt = [rng.randrange(1, 4) for _ in range(a)]  # tiny vocab: many shared prefixes
            prompts.append(prompt)
            s.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=b), eos_token_id=EOS, priority=c))
        elif kind == "group":
            prompt = [rng.randrange(1, 4) for _ in range(a)]
            s.add_request_group([Request(f"g{n}.{i}", prompt, SamplingParams(max_tokens=b), eos_token_id=EOS)
                                 for i in range(c)])
        elif kind == "step":
            for _ in range(a):
                model.step(s)
        elif kind in ("abort", "finish") and s.requests:
            rid = sorted(s.requests)[a % len(s.requests)]
            if kind == "abort":
                s.abort_request(rid)
            else:
                s.finish_request(rid, "stop", stop_reason="###")
        elif kind == "preempt" and s.running:
            s._preempt(s.running[a % len(s.running)])
        check_invariants(s)
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        model.step(s)
        check_invariants(s)
    assert not s.has_unfinished_requests()
    assert s.stats().used_blocks == 0 and not s.waiting and not s.running


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_simulation_200_requests_all_finish_with_preemptions(policy):
    rng = random.Random(1234)
    clock = {"now": 0.0}
    num_blocks = 24
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, policy=policy, sjf_aging_s=1.0),
        CacheConfig(block_size=BS, num_blocks=num_blocks),
        clock=lambda: clock["now"],
    )
    model = FakeModel(num_blocks, rng)
    pending = []
    for i in range(200):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 48))]
        params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7)
        pending.append((i // 4, Request(f"r{i}", prompt, params, eos_token_id=EOS,
                                        priority=rng.randint(0, 3), arrival_time=i // 4 * 0.1)))
    added_at, finished_at = {}, {}
    for step_no in range(5000):
        clock["now"] = step_no * 0.1
        while pending and pending[0][0] <= step_no:
            _, r = pending.pop(0)
            s.add_request(r)
            added_at[r.request_id] = step_no
        for r in model.step(s):
            finished_at[r.request_id] = step_no
            assert r.finish_reason in ("stop", "length")
            assert r.num_output_tokens <= r.max_tokens
        if not pending and not s.has_unfinished_requests():
            break
        if step_no % 25 == 0:
            check_invariants(s)
    assert len(finished_at) == 200, f"unfinished: {sorted(set(added_at) - set(finished_at))}"
    stats = s.stats()
    assert stats.num_preemptions > 0
    assert stats.used_blocks == 0 and stats.free_blocks == num_blocks
    waits = [finished_at[k] - added_at[k] for k in added_at]
    assert max(waits) < 2000  # nobody starves
