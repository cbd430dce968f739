"""Tensor parallelism's arithmetic and collectives: which slice of each weight a rank holds, and the three
operations the sharded forward needs (sum, gather of logits, minimum of a count).

Megatron-style over `size` ranks of one torch.distributed group (gloo on CPU, NCCL on CUDA):
- query heads, the gate/up rows and the down/o columns are split evenly: `size` must divide the query heads and
  the intermediate size;
- KV heads are split when `size` divides them, and replicated when the KV heads divide `size` (rank r holds KV
  head r * kv_heads // size, which is the one its query heads read, as in vLLM);
- the vocabulary (embedding, lm_head) is split in equal shards of ceil(V / size) rows, the last one padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpu_worker.executor.shm_comm import ShmComm


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the group; its collectives run on torch.distributed's default group (the forward's
    backend), or through `shm` where it fits."""

    rank: int
    size: int
    shm: ShmComm | None = None  # CPU ranks of one machine: collectives through shared memory where they fit

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (the row-parallel o / down projections and the vocab-parallel embedding)."""
        if self.size > 1 and self.shm is not None and x.device.type == "cpu" and self.shm.fits(x.numel()):
            return self.shm.all_reduce(x)
        if self.size > 1:
            if x.dtype == torch.bfloat16 and x.device.type == "cpu":  # gloo sums bf16 slowly, or not at all
                summed = x.float()
                dist.all_reduce(summed)
                x.copy_(summed)
            else:
                dist.all_reduce(x)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, V / size] logits of this rank's vocabulary shard -> [N, V] on every rank."""
        if self.size == 1:
            return x[:, :vocab_size]
        if self.shm is not None and x.device.type == "cpu" and self.shm.fits(x.numel()):
            return self.shm.all_gather(x)[:, :vocab_size]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest `value` any rank holds (the KV blocks every rank can allocate)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group())
        return int(t.item())


_CPU_GROUP: Any = None


def cpu_group() -> Any:
    """A gloo group over every rank for CPU tensors (the step's ints, counts), whatever the forward's backend:
    NCCL moves only device tensors. Created once, by every rank, right after init_process_group."""
    return _CPU_GROUP


def init_cpu_group(timeout_s: float) -> None:
    global _CPU_GROUP
    from datetime import timedelta

    _CPU_GROUP = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                  if dist.get_backend() != "gloo" else None)


def check_divisible(*, num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """A clear error, before any process starts, when the model cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {num_kv_heads} KV heads, or be a "
                         f"multiple of them (the KV heads are then replicated)")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's MLP size {intermediate_size}")


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    return max(num_kv_heads // size, 1)


def first_kv_head(num_kv_heads: int, rank: int, size: int) -> int:
    """The first (global) KV head rank `rank` holds."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank * num_kv_heads // size  # replicated: the head this rank's query heads read


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """-> (first row, rows held, shard size): rank `rank`'s rows of a [V, H] embedding; shards are ceil(V / size)
    rows, the last one holding fewer real rows (the rest zero)."""
    shard = -(-vocab_size // size)
    first = min(rank * shard, vocab_size)
    return first, min(shard, vocab_size - first), shard
