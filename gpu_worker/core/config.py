"""Engine configuration: the KV cache's and the scheduler's settings as the CLI / LLM(...) give them, and the
arithmetic that sizes the cache from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.core.policies import SchedulingPolicy, policy_class


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # resolved before the pool is built (explicit count, or from a memory budget)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048  # context window: prompt + output tokens
    policy: str | SchedulingPolicy = "fcfs"  # a built-in name, "package.module:Class" or a policy object
    sjf_aging_s: float = 10.0  # sjf: a waiting request gains one block_size of "shortness" per this many seconds
    log_memory_usage_s: float = 0.0  # > 0: log the KV cache's memory use every this many seconds

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            try:
                policy_class(self.policy)  # a user's class is imported now: a wrong name fails before a model loads
            except ValueError as e:
                raise ValueError(f"scheduling_policy (--scheduling-policy) {e}") from None
        elif not isinstance(self.policy, SchedulingPolicy):
            raise ValueError(f"scheduling_policy must be a built-in name, 'package.module:Class' or a SchedulingPolicy "
                             f"object, got {self.policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


def num_blocks_for_memory(
    memory_bytes: int, *, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """How many KV blocks fit in `memory_bytes`: each block holds keys and values of every layer."""
    per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    return memory_bytes // per_block


def parse_memory_size(text: str | int) -> int:
    """'4GiB', '512MB', '1.5G', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    for unit, factor in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * factor)
    try:
        return int(float(s))
    except ValueError:
        raise ValueError(f"memory size {text!r} is not a size like '2GiB', '512MB' or a byte count") from None
