"""Where prompt prefixes went: the `prefix` routing policy's approximate view of each worker's prefix cache.

Each full block of a prompt gets a chained hash (like the workers' prefix cache: a block's hash covers every
token before it). When a request is routed, its block hashes are mapped to the chosen worker in Redis (shared
by gateway replicas, with a TTL); the next request's overlap with worker w is the number of its leading
blocks last routed to w.
"""

from __future__ import annotations

import hashlib
from typing import Any

from shared import keys

PREFIX_TTL_S = 600
MAX_BLOCKS = 256  # longer prompts are matched on their first MAX_BLOCKS blocks


def block_hashes(token_ids: list[int], block_size: int, model: str) -> list[str]:
    hashes, parent = [], model.encode()
    for start in range(0, min(len(token_ids) // block_size, MAX_BLOCKS) * block_size, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=12).hexdigest()
        hashes.append(digest)
        parent = digest.encode()
    return hashes


async def overlap(r: Any, hashes: list[str]) -> dict[str, int]:
    """worker id -> leading prompt blocks last routed there."""
    if not hashes:
        return {}
    owners = await r.mget([keys.prefix_block(h) for h in hashes])
    result: dict[str, int] = {}
    alive: set[str] | None = None  # workers still matching every block so far
    for owner in owners:
        if owner is None or (alive is not None and owner not in alive):
            break
        result[owner] = result.get(owner, 0) + 1
        alive = {owner}
    return result


def remember_commands(pipe: Any, hashes: list[str], worker_id: str) -> None:
    for h in hashes:
        pipe.set(keys.prefix_block(h), worker_id, ex=PREFIX_TTL_S)
