"""Rotary position embedding of queries and keys (neox halves or GPT-J interleaved pairs).

RoPE scaling (llama3, linear, ...) is folded into cos_sin_cache by the model, so the kernel only reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import check_float, check_last_dim_contiguous, check_launch, next_pow2


@triton.jit
def _rotate(x_ptr, out_ptr, stride_xt, stride_ot, t, cos, sin,
            NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
            HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_i = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_i < HEAD_DIM // 2)  # [HEADS_PAD, HALF_PAD]
    if IS_NEOX:
        i1 = offs_i
        i2 = offs_i + HEAD_DIM // 2
    else:
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    x_row = x_ptr + t * stride_xt + offs_h * HEAD_DIM
    x1 = tl.load(x_row + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2, mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + t * stride_ot + offs_h * HEAD_DIM
    tl.store(out_row + i1, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + i2, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    q_out_ptr, k_out_ptr, q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_kt, stride_qot, stride_kot, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    offs_i = tl.arange(0, HALF_PAD)
    i_ok = offs_i < HEAD_DIM // 2
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM // 2 + offs_i, mask=i_ok,
                  other=0.0).to(tl.float32)[None, :]
    _rotate(q_ptr, q_out_ptr, stride_qt, stride_qot, t, cos, sin,
            NUM_Q_HEADS, Q_HEADS_PAD, HEAD_DIM, HALF_PAD, IS_NEOX)
    _rotate(k_ptr, k_out_ptr, stride_kt, stride_kot, t, cos, sin,
            NUM_KV_HEADS, KV_HEADS_PAD, HEAD_DIM, HALF_PAD, IS_NEOX)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos | sin halves
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of gpu_worker.executor.ops.torch_ops.rotary_embedding: new rotated (query, key); inputs are untouched."""
    op = "rotary_embedding"
    check_launch(op, _rotary_embedding_kernel, positions=positions, query=query, key=key,
                 cos_sin_cache=cos_sin_cache)
    check_float(op, query=query, key=key, cos_sin_cache=cos_sin_cache)
    num_tokens = positions.shape[0]
    if positions.dtype != torch.int64 or positions.dim() != 1 or not positions.is_contiguous():
        raise ValueError(f"{op}: positions must be a contiguous int64 [T] tensor; got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"{op}: cos_sin_cache must be [max_pos, head_dim={head_dim}] (even head_dim); got "
                         f"{tuple(cos_sin_cache.shape)}")
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] % head_dim:
            raise ValueError(f"{op}: {name} must be [T={num_tokens}, heads * {head_dim}]; got {tuple(t.shape)}")
    check_last_dim_contiguous(op, query=query, key=key, cos_sin_cache=cos_sin_cache)
    q_out = torch.empty(query.shape, dtype=torch.promote_types(query.dtype, cos_sin_cache.dtype),
                        device=query.device)  # [T, Hq * D]
    k_out = torch.empty(key.shape, dtype=torch.promote_types(key.dtype, cos_sin_cache.dtype),
                        device=key.device)  # [T, Hkv * D]
    if num_tokens:
        num_q_heads, num_kv_heads = query.shape[1] // head_dim, key.shape[1] // head_dim
        _rotary_embedding_kernel[(num_tokens,)](
            q_out, k_out, query, key, positions, cos_sin_cache,
            query.stride(0), key.stride(0), q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_PAD=next_pow2(num_q_heads),
            KV_HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim, HALF_PAD=next_pow2(head_dim // 2),
            IS_NEOX=is_neox, num_warps=4,
        )
    return q_out, k_out
