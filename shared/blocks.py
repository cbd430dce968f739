"""KV-block arithmetic that the gateway (routing, limits) and the worker (reservations, status) must agree on."""

from __future__ import annotations

import hashlib

MAX_HASHED_BLOCKS = 256  # the prefix index matches longer prompts on their first MAX_HASHED_BLOCKS blocks


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def request_blocks(prompt_tokens: int, output_tokens: int, n: int, block_size: int) -> int:
    """KV blocks a request holds at its largest: the prompt's once (the n choices share them), plus each
    choice's output (its first output block may be a copy of the shared last prompt block)."""
    if n == 1:
        return blocks_for(prompt_tokens + output_tokens, block_size)
    shared = prompt_tokens // block_size
    return shared + n * blocks_for(prompt_tokens - shared * block_size + output_tokens, block_size)


def block_hashes(token_ids: list[int], block_size: int, model: str) -> list[str]:
    """A chained hash of each full block of a prompt (at most MAX_HASHED_BLOCKS), as the prefix index keys
    them: like the workers' prefix cache, a block's hash covers every token before it, and the model's name."""
    hashes, parent = [], model.encode()
    for start in range(0, min(len(token_ids) // block_size, MAX_HASHED_BLOCKS) * block_size, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=12).hexdigest()
        hashes.append(digest)
        parent = digest.encode()
    return hashes
