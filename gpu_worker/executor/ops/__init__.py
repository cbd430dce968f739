"""The model's hot operations, stated once.

`Ops` is what every implementation provides, with its shapes: the torch reference (torch_ops), kvfleet's
native CPU kernels (cpu/native_ops, built from cpu/csrc) and the Triton kernels (kernels/). `select_ops` picks
one implementation per operation, once, when a model is built. `AttentionMetadata` holds the paged-attention
inputs of one step, shared by every layer. KV cache per layer: key_cache, value_cache:
[num_blocks, block_size, num_kv_heads, head_dim] as every op indexes them (on CPU head-major in memory:
cpu/kernels.head_major_kv_cache; every implementation takes the strides).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from gpu_worker.executor.ops import torch_ops

log = logging.getLogger(__name__)


class Ops(Protocol):
    def store_kv_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; -1 = skip
    ) -> None:
        """Write each token's key/value into its slot."""

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        query_start_loc: torch.Tensor,  # [S + 1] int32
        context_lens: torch.Tensor,  # [S] int32, tokens including this step's
        scale: float,
    ) -> torch.Tensor:
        """-> [T, Hq, D]: every query token over its sequence's paged keys/values, causally (query i of
        sequence s sits at position context_lens[s] - q_len_s + i)."""

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, H]
        weight: torch.Tensor,  # [H]
        eps: float,
        residual: torch.Tensor | None = None,  # [T, H]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm with float32 statistics; with `residual`, (normed(x + residual), x + residual)."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, Hq * D]
        key: torch.Tensor,  # [T, Hkv * D]
        cos_sin_cache: torch.Tensor,  # [max_positions, D]: cos | sin halves
        head_dim: int,
        is_neox: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, key) rotated by their positions (neox: halves; otherwise interleaved pairs)."""


OP_NAMES = ("store_kv_cache", "paged_attention", "rms_norm", "silu_and_mul", "rotary_embedding")


@dataclass
class AttentionMetadata:
    """The paged-attention inputs of one step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32


def select_ops(device: torch.device, use_triton: bool | None) -> Ops:
    """The ops, chosen once: Triton kernels (kernels/) on CUDA or when asked; on CPU kvfleet's native kernels
    where they build; the torch reference for the rest."""
    chosen = {name: getattr(torch_ops, name) for name in OP_NAMES}
    if device.type == "cpu":
        from gpu_worker.executor.ops.cpu.native_ops import cpu_ops

        chosen.update(cpu_ops())
    if use_triton or (use_triton is None and device.type == "cuda"):
        import kernels

        missing = [name for name in OP_NAMES if not hasattr(kernels, name)]
        chosen.update({name: getattr(kernels, name) for name in OP_NAMES if name not in missing})
        if missing:
            log.warning("kernels/ lacks %s: using the torch ops for those", ", ".join(missing))
    return cast(Ops, types.SimpleNamespace(**chosen))
