"""KV-block arithmetic that the gateway (routing, limits) and the worker (reservations, status) must agree on."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def request_blocks(prompt_tokens: int, output_tokens: int, n: int, block_size: int) -> int:
    """KV blocks a request holds at its largest: the prompt's once (the n choices share them), plus each
    choice's output (its first output block may be a copy of the shared last prompt block)."""
    if n == 1:
        return blocks_for(prompt_tokens + output_tokens, block_size)
    shared = prompt_tokens // block_size
    return shared + n * blocks_for(prompt_tokens - shared * block_size + output_tokens, block_size)
