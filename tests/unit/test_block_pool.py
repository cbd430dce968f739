"""Block pool: free queue order, ref counts, prefix-cache hash map and LRU eviction (exact block ids)."""

import pytest

from gpu_worker.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock

pytestmark = pytest.mark.unit


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_remove_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert not FreeKVCacheBlockQueue.contains(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert ids(q) == [0, 1, 3, 4, 2]
    for _ in range(5):
        q.popleft()
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_rejects_double_insert_and_missing_remove():
    b = KVCacheBlock(0)
    q = FreeKVCacheBlockQueue([b])
    with pytest.raises(AssertionError):
        q.append(b)
    q.remove(b)
    with pytest.raises(AssertionError):
        q.remove(b)


def test_allocate_and_free_reuses_uncached_blocks_first():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2] and [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.get_new_blocks(6) is None  # too few: nothing changes
    assert pool.num_free_blocks == 5
    pool.free_blocks(reversed(a))  # uncached blocks go to the head
    assert ids(pool.free_queue) == [0, 1, 2, 3, 4, 5, 6, 7]
    pool.check_invariants()


def test_double_free_is_caught():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_cached_blocks_stay_until_evicted_least_recently_used_first():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)  # 0, 1
    assert pool.cache_block(a[0], 111) and pool.cache_block(a[1], 222)
    pool.free_blocks(reversed(a))  # cached: to the tail, the last block first
    assert ids(pool.free_queue) == [2, 3, 1, 0]
    assert pool.get_cached_block(111) is a[0] and pool.num_cached_blocks == 2
    # prefix hit: take block 0 from the middle of the queue
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and ids(pool.free_queue) == [2, 3, 1]
    pool.check_invariants()
    # reuse: 2, 3 (uncached) go first, then 1 is evicted (its hash forgotten)
    b = pool.get_new_blocks(3)
    assert ids(b) == [2, 3, 1]
    assert pool.get_cached_block(222) is None and a[1].block_hash is None
    assert pool.get_cached_block(111) is a[0] and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_duplicate_content_is_not_cached_twice_and_touch_shares():
    pool = BlockPool(4)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_block(x, 7)
    assert not pool.cache_block(y, 7)  # same tokens in another block: the first one stays the cached copy
    assert y.block_hash is None
    pool.touch([x])
    assert x.ref_cnt == 2
    pool.free_blocks([x])
    assert x.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_reset_prefix_cache_forgets_every_hash_only_when_no_block_is_referenced():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert pool.cache_block(a[0], 111) and pool.cache_block(a[1], 222)
    assert not pool.reset_prefix_cache()  # referenced: nothing changes
    assert pool.get_cached_block(111) is a[0] and a[1].block_hash == 222
    pool.free_blocks(reversed(a))
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(111) is None
    assert a[0].block_hash is None and a[1].block_hash is None
    assert pool.num_free_blocks == 4
    pool.check_invariants()
    b = pool.get_new_blocks(1)  # the pool goes on as before
    assert pool.cache_block(b[0], 111) and pool.get_cached_block(111) is b[0]


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert not pool.cache_block(b, 5)
    assert pool.get_cached_block(5) is None and pool.num_cached_blocks == 0


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)
