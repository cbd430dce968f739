"""The block pool: physical KV blocks, their reference counts, the free queue and the prefix-cache hash map.

Invariant (asserted): a block is in the free queue exactly when its ref count is 0.
A freed block that holds a cached (hashed) full block keeps its hash in the free queue, so a later request
can still hit it; it is evicted (hash forgotten) only when it is popped from the queue to be reused.
The queue's head is what gets reused next: blocks without a hash go to the head, cached blocks to the
tail, so the least recently used cached block is evicted first and uncached ones are reused before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One physical block of `block_size` token slots (metadata only; the tensors live in the runner)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full and registered in the prefix cache
        self.prev_free: KVCacheBlock | None = None  # links in the free queue (both None when not in it)
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append, appendleft and remove from the middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    @staticmethod
    def contains(block: KVCacheBlock) -> bool:
        return block.next_free is not None

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert not self.contains(block), f"{block} is already in the free queue"
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Add at the tail: reused last."""
        assert self._tail.prev_free is not None
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add at the head: reused first."""
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block


class BlockPool:
    """Owns every physical block: allocation, ref counts, free queue, block hash -> cached block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> the block holding those tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, num: int) -> list[KVCacheBlock] | None:
        """Pop `num` blocks from the head of the free queue (evicting their cached hashes); None if too few."""
        if num > len(self.free_queue):
            return None
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, f"{block} was in the free queue with a reference"
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (a free one leaves the middle of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order; a block whose count hits 0 becomes free."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            assert not FreeKVCacheBlockQueue.contains(block), f"{block} is referenced and in the free queue"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register a full block under its hash; False when another block already holds those tokens."""
        if not self.enable_caching:
            return False
        assert block.ref_cnt > 0, f"caching unreferenced {block}"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"{block} re-hashed as {block_hash}"
            return True
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, so that no later request hits what ran before (benchmark rounds, or
        after new weights). Only while no block is referenced; False (and nothing changed) otherwise."""
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        """Assert the pool's invariants (tests and debugging; O(num_blocks))."""
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == len(self.free_queue), "free queue holds a block twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.block_id in in_queue) == (block.ref_cnt == 0), f"free queue out of sync: {block}"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map out of sync: {block_hash} -> {block}"
