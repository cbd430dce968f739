"""KV cache manager: block tables, slot mapping, prefix hits, fork + copy-on-write, free (exact block ids)."""

import pytest

from gpu_worker.core.kv_cache_manager import KVCacheManager, compute_block_hashes
from gpu_worker.core.request import Request
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4


def make_request(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(max_tokens=8))


def run(kvm, req, n, hit_blocks=()):
    """Allocate like the scheduler does, then advance the computed counter."""
    new = kvm.allocate_slots(req, n, hit_blocks)
    assert new is not None
    req.num_computed_tokens += len(hit_blocks) * BS + n
    return [b.block_id for b in new]


def refs(kvm):
    return [b.ref_cnt for b in kvm.block_pool.blocks]


def test_allocate_append_and_slot_mapping():
    kvm = KVCacheManager(BS, 8)
    r = make_request("a", range(10))
    assert run(kvm, r, 10) == [0, 1, 2]
    assert kvm.get_block_ids("a") == [0, 1, 2]
    assert kvm.slot_mapping("a", 8, 2) == [8, 9]
    s = kvm.stats()
    assert (s.used_blocks, s.free_blocks, s.allocated_slots, s.stored_tokens, s.fragmentation_slots) == (3, 5, 12, 10, 2)
    r.output_token_ids += [100, 101]
    assert run(kvm, r, 1) == []  # slot 10 fits in block 2
    assert run(kvm, r, 1) == []  # slot 11
    r.output_token_ids.append(102)
    assert run(kvm, r, 1) == [3]  # block 2 full: one new block
    assert kvm.slot_mapping("a", 12, 1) == [12]
    assert kvm.stats().fragmentation_slots == 3


def test_allocate_never_over_commits():
    kvm = KVCacheManager(BS, 3)
    r = make_request("a", range(13))
    assert kvm.allocate_slots(r, 13) is None  # needs 4 blocks
    assert kvm.get_block_ids("a") == [] and kvm.block_pool.num_free_blocks == 3
    assert run(kvm, r, 12) == [0, 1, 2]
    assert kvm.allocate_slots(r, 1) is None


def test_prefix_hit_never_covers_the_whole_prompt():
    kvm = KVCacheManager(BS, 8)
    a = make_request("a", range(10))
    run(kvm, a, 10)
    kvm.cache_blocks(a, 10)  # blocks 0, 1 are full; block 2 is partial and not cached
    assert kvm.stats().cached_blocks == 2
    b = make_request("b", [*range(8), 50, 51, 52])
    hit, n = kvm.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1] and n == 8
    assert run(kvm, b, 3, hit) == [3]
    assert kvm.get_block_ids("b") == [0, 1, 3]
    assert refs(kvm)[:4] == [2, 2, 1, 1]
    # a prompt of exactly two cached blocks hits one: its last token must be computed for logits
    c = make_request("c", range(8))
    hit, n = kvm.get_computed_blocks(c)
    assert [x.block_id for x in hit] == [0] and n == 4
    s = kvm.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10 + 11, 8)


def test_hash_chain_names_the_whole_prefix():
    h1 = compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = compute_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and h1[0] != h2[0] and h1[1] != h2[1]  # same second block, different parent
    assert compute_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == h1  # partial blocks are not hashed
    kvm = KVCacheManager(BS, 8)
    r = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kvm.get_computed_blocks(r)
    assert r.block_hashes == h1  # the manager's chain is the public one (the router can compute it too)


def test_free_in_reverse_order_and_lru_eviction():
    kvm = KVCacheManager(BS, 6)
    a = make_request("a", range(10))
    run(kvm, a, 10)  # 0, 1, 2
    kvm.cache_blocks(a, 10)
    kvm.free(a)
    assert refs(kvm) == [0] * 6
    # uncached block 2 is reused first; cached blocks sit at the tail, the prefix's tail block first
    assert [b.block_id for b in kvm.block_pool.free_queue] == [2, 3, 4, 5, 1, 0]
    b = make_request("b", range(100, 120))
    assert run(kvm, b, 16) == [2, 3, 4, 5]
    assert kvm.stats().cached_blocks == 2
    assert run(kvm, b, 4) == [1]  # evicts a's second block
    assert kvm.stats().cached_blocks == 1
    hit, n = kvm.get_computed_blocks(make_request("c", range(10)))
    assert [x.block_id for x in hit] == [0] and n == 4  # the first block is still cached
    kvm.block_pool.check_invariants()


def test_hit_on_a_freed_cached_block_takes_it_from_the_free_queue():
    kvm = KVCacheManager(BS, 4)
    a = make_request("a", range(9))
    run(kvm, a, 9)
    kvm.cache_blocks(a, 9)
    kvm.free(a)
    b = make_request("b", range(9))
    hit, n = kvm.get_computed_blocks(b)
    assert n == 8
    assert kvm.allocate_slots(b, 1, hit) is not None
    assert kvm.get_block_ids("b") == [0, 1, 2]
    assert refs(kvm) == [1, 1, 1, 0]
    kvm.block_pool.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_block():
    kvm = KVCacheManager(BS, 8)
    leader = make_request("g0", range(6))
    sib = make_request("g1", range(6))
    assert run(kvm, leader, 5) == [0, 1]  # prompt[:-1]: block 1 holds one token
    kvm.fork(leader, sib)
    sib.num_computed_tokens = 5
    assert kvm.get_block_ids("g1") == [0, 1] and refs(kvm)[:2] == [2, 2]
    assert run(kvm, sib, 1) == [2]  # writes into shared block 1: copy it first
    assert kvm.get_block_ids("g1") == [0, 2]
    assert kvm.take_pending_copies() == [(1, 2)]
    assert kvm.take_pending_copies() == []
    assert refs(kvm)[:3] == [2, 1, 1]
    assert run(kvm, leader, 1) == []  # block 1 is its own again: written in place
    assert kvm.take_pending_copies() == []
    # fragmentation counts each partial block once
    assert kvm.stats().fragmentation_slots == 2 + 2
    kvm.free(sib)
    kvm.free(leader)
    assert refs(kvm) == [0] * 8
    kvm.block_pool.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
    kvm = KVCacheManager(BS, 8)
    leader, sib = make_request("g0", range(5)), make_request("g1", range(5))
    run(kvm, leader, 4)
    kvm.fork(leader, sib)
    sib.num_computed_tokens = 4
    assert run(kvm, sib, 1) == [1]
    assert run(kvm, leader, 1) == [2]
    assert kvm.take_pending_copies() == []
    assert refs(kvm)[:3] == [2, 1, 1]


def test_copy_on_write_needs_a_free_block():
    kvm = KVCacheManager(BS, 2)
    leader, sib = make_request("g0", range(6)), make_request("g1", range(6))
    run(kvm, leader, 5)
    kvm.fork(leader, sib)
    sib.num_computed_tokens = 5
    assert kvm.allocate_slots(sib, 1) is None
    assert kvm.get_block_ids("g1") == [0, 1] and kvm.take_pending_copies() == []


def test_freeing_a_copy_destination_drops_the_pending_copy():
    kvm = KVCacheManager(BS, 8)
    leader, sib = make_request("g0", range(6)), make_request("g1", range(6))
    run(kvm, leader, 5)
    kvm.fork(leader, sib)
    sib.num_computed_tokens = 5
    run(kvm, sib, 1)
    kvm.free(sib)  # preempted in the same step
    assert kvm.take_pending_copies() == []
    assert refs(kvm)[:3] == [1, 1, 0]


def test_prefix_caching_disabled():
    kvm = KVCacheManager(BS, 8, enable_caching=False)
    a = make_request("a", range(10))
    run(kvm, a, 10)
    kvm.cache_blocks(a, 10)
    assert kvm.get_computed_blocks(make_request("b", range(10))) == ([], 0)
    s = kvm.stats()
    assert (s.cached_blocks, s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0, 0)
