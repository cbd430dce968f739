"""KV-cache store: write each new token's keys and values into its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import check_float, check_last_dim_contiguous, check_launch, next_pow2


@triton.jit
def _kv_cache_store_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64; -1 marks a padded token
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)  # [HEADS_PAD, HEAD_PAD]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h * stride_kch + offs_d,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h * stride_vch + offs_d,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Triton version of gpu_worker.executor.ops.torch_ops.store_kv_cache: cache[slot // block_size, slot % block_size] = kv."""
    op = "store_kv_cache"
    check_launch(op, _kv_cache_store_kernel, key=key, value=value, key_cache=key_cache,
                 value_cache=value_cache, slot_mapping=slot_mapping)
    check_float(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"{op}: key and value must both be [T, Hkv, D]; got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"{op}: key_cache and value_cache must be [num_blocks, block_size, {key.shape[1]}, "
                         f"{key.shape[2]}]; got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_tokens, num_heads, head_dim = key.shape
    if (slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (num_tokens,)
            or not slot_mapping.is_contiguous()):
        raise ValueError(f"{op}: slot_mapping must be a contiguous int64 tensor of shape ({num_tokens},); got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)} strides {slot_mapping.stride()}")
    check_last_dim_contiguous(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if num_tokens == 0:
        return
    _kv_cache_store_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_heads), HEAD_PAD=next_pow2(head_dim),
        num_warps=4,
    )
