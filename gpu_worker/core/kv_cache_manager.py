"""The KV cache manager: each request's block table, slot allocation, prefix caching, sharing, copy-on-write.

Works on ints and ids only. Full blocks are identified by chained hashes: hash(parent hash, block tokens),
so a block's hash names its whole prefix. Blocks are registered in the prefix cache only once their
keys/values have been written (the scheduler calls `cache_blocks` after the forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_worker.core.block_pool import BlockPool, KVCacheBlock
from gpu_worker.core.request import Request

ROOT_BLOCK_HASH = 0x6B7666_6C656574  # parent hash of a sequence's first block (stable across processes)


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash (ints only: stable across processes)."""
    return hash((parent_hash, tuple(token_ids)))


def compute_block_hashes(token_ids: Sequence[int], block_size: int, known: list[int] | None = None) -> list[int]:
    """Chained hashes of every full block of `token_ids`; extends `known` (the hashes of a prefix) in place."""
    hashes = known if known is not None else []
    parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass
class KVCacheStats:
    total_blocks: int
    free_blocks: int  # includes freed blocks that still hold cached prefixes (they are evictable)
    used_blocks: int
    cached_blocks: int  # blocks registered in the prefix cache (in use or free)
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found
    allocated_slots: int  # used_blocks * block_size
    stored_tokens: int  # slots holding (or about to hold) a token
    fragmentation_slots: int  # allocated_slots - stored_tokens

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_slots: dict[str, int] = {}  # request -> token slots assigned in its table
        self._num_cached: dict[str, int] = {}  # request -> leading blocks already registered in the cache
        self._pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) not yet handed out
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- lookups -------------------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def slot_mapping(self, request_id: str, start: int, num_tokens: int) -> list[int]:
        """Physical slot (block_id * block_size + offset) of positions [start, start + num_tokens)."""
        blocks, bs = self.req_to_blocks[request_id], self.block_size
        return [blocks[pos // bs].block_id * bs + pos % bs for pos in range(start, start + num_tokens)]

    def _update_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """The request's block hashes, extended to cover the full blocks of its first `num_tokens` tokens."""
        bs, hashes = self.block_size, request.block_hashes
        start, n_full = len(hashes), num_tokens // self.block_size
        if start < n_full:
            tokens = request.token_ids(start * bs, n_full * bs)  # only the blocks not hashed yet
            parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
            for i in range(n_full - start):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, hit tokens). Takes no references.

        Never covers every token: at least one must be computed so the model produces logits.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._update_hashes(request, max_hit_blocks * self.block_size)
        hit: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    # ---- allocation ----------------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` after the request's computed tokens (plus any prefix hit).

        Returns the newly allocated blocks (possibly []), or None when the free blocks do not suffice
        (nothing is changed then). A shared partial last block about to be written is copied first.
        """
        rid = request.request_id
        admitting = rid not in self.req_to_blocks
        blocks = self.req_to_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_slots = num_computed + num_new_tokens
        num_required = self.num_blocks_for(num_slots)
        num_new = max(0, num_required - len(blocks) - len(new_computed_blocks))
        write_idx = num_computed // self.block_size
        cow = num_new_tokens > 0 and write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        num_touched_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new + int(cow) + num_touched_free > self.block_pool.num_free_blocks:
            return None

        if admitting:
            self.req_to_blocks[rid] = blocks
            self._num_cached[rid] = len(new_computed_blocks)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        allocated: list[KVCacheBlock] = []
        if cow:
            (fresh,) = self.block_pool.get_new_blocks(1) or ()
            shared = blocks[write_idx]
            self._pending_copies.append((shared.block_id, fresh.block_id))
            self.block_pool.free_blocks([shared])  # still referenced by its other holders
            blocks[write_idx] = fresh
            allocated.append(fresh)
        fresh_blocks = self.block_pool.get_new_blocks(num_new)
        assert fresh_blocks is not None
        blocks.extend(fresh_blocks)
        allocated.extend(fresh_blocks)
        self._num_slots[rid] = max(self._num_slots.get(rid, 0), num_slots)
        return allocated

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks among the request's first `num_tokens` tokens (their KV is written)."""
        if not self.enable_caching or request.request_id not in self.req_to_blocks:
            return
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        n_full = min(num_tokens // self.block_size, len(blocks))
        start = self._num_cached[rid]
        if n_full <= start:
            return
        hashes = self._update_hashes(request, n_full * self.block_size)
        for i in range(start, n_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached[rid] = n_full

    def fork(self, src_request: Request, dst_request: Request) -> None:
        """dst shares all of src's blocks (one more reference each); writes later copy-on-write."""
        src, dst = src_request.request_id, dst_request.request_id
        assert dst not in self.req_to_blocks, f"request {dst} already has blocks"
        blocks = list(self.req_to_blocks[src])
        self.block_pool.touch(blocks)
        self.req_to_blocks[dst] = blocks
        self._num_slots[dst] = self._num_slots[src]
        self._num_cached[dst] = self._num_cached[src]

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (so its tail is evicted before its prefix)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self._num_slots.pop(rid, None)
        self._num_cached.pop(rid, None)
        if not blocks:
            return
        self.block_pool.free_blocks(reversed(blocks))
        freed = {b.block_id for b in blocks if b.ref_cnt == 0}
        if freed and self._pending_copies:
            self._pending_copies = [(s, d) for s, d in self._pending_copies if d not in freed]

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (BlockPool.reset_prefix_cache): False while a request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs since the last call; the runner applies them before its forward."""
        out, self._pending_copies = self._pending_copies, []
        return out

    # ---- statistics ----------------------------------------------------------------------------------
    def stats(self) -> KVCacheStats:
        pool, bs = self.block_pool, self.block_size
        # Only a table's last block can be partly filled; a shared one is counted once, at its fullest.
        last_fill: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            if blocks:
                fill = self._num_slots[rid] - (len(blocks) - 1) * bs
                last = blocks[-1].block_id
                last_fill[last] = max(last_fill.get(last, 0), fill)
        allocated = pool.num_used_blocks * bs
        fragmentation = sum(bs - fill for fill in last_fill.values())
        return KVCacheStats(
            total_blocks=pool.num_blocks,
            free_blocks=pool.num_free_blocks,
            used_blocks=pool.num_used_blocks,
            cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            allocated_slots=allocated,
            stored_tokens=allocated - fragmentation,
            fragmentation_slots=fragmentation,
        )
