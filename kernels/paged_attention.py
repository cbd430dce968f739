"""Paged attention (prefill, chunked prefill and decode) through the block table, with online softmax.

One program handles BLOCK_Q query tokens of one sequence times the GROUP query heads that share one KV
head (BLOCK_M = BLOCK_Q * GROUP_PAD score rows), so each K/V tile is read once per KV head and GQA
costs no extra memory traffic. Keys are read in tiles of BLOCK_N tokens, gathered through the block
table (any block size), so one tile spans several KV blocks.

Decode batches (one query token per sequence) use BLOCK_Q = 1 and split the context into NUM_SPLITS
parts (flash-decoding) when there are too few (sequence, KV head) programs to fill the GPU; a second
kernel merges the parts by their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import check_float, check_last_dim_contiguous, check_launch, interpreted, next_pow2

_LOG2E = 1.4426950408889634  # 1 / ln 2: scores are kept in the log2 domain (exp2)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Binary search: the sequence whose query blocks contain `q_block`. With BLOCK_Q > 1 each sequence
    s owns blocks [start_s // BLOCK_Q + s, ...): the + s leaves room for its partial last block."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,  # part_*: [T, Hq, num_splits, (HEAD_PAD)] fp32
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    qk_scale, num_seqs, num_splits, tiles_per_split,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if BLOCK_Q > 1:
        q_local = q_block - (q_start // BLOCK_Q + seq)
    else:
        q_local = q_block - q_start
    if q_local * BLOCK_Q >= q_len:  # the spare block after a sequence whose length is a multiple of BLOCK_Q
        return
    ctx = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_local * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query token within the sequence
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M] query head
    row_ok = (q_idx < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = ctx - q_len + q_idx  # [BLOCK_M] absolute position: attends to keys 0..q_pos
    tok = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    kv_end = tl.minimum(ctx, ctx - q_len + (q_local + 1) * BLOCK_Q)  # keys [0, kv_end) for this block
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tl.cdiv(kv_end, BLOCK_N), tile_lo + tiles_per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = offs_n < kv_end
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_kt
                    + kv_head * stride_kh + offs_d[:, None],
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(q.dtype)  # [HEAD_PAD, BLOCK_N]
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt
                    + kv_head * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, HEAD_PAD]
        if DOT_FP32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at zero weight
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        part = (tok * NUM_Q_HEADS + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_splits, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_PAD)
    part = (tok * NUM_Q_HEADS + head) * num_splits + offs_s  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [SPLITS_PAD], 0 for empty splits
    total = tl.sum(tl.load(part_sum_ptr + part, mask=s_ok, other=0.0) * w, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [HEAD_PAD]
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _num_splits(device: torch.device, programs: int, num_tiles: int, interpret: bool) -> int:
    """Context splits for a decode batch: enough programs to cover every SM a few times over."""
    target = 16 if interpret else 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_tiles, -(-target // programs), 64))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32, padded with -1 or 0
    query_start_loc: torch.Tensor,  # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32, tokens incl. this step's
    scale: float,
) -> torch.Tensor:
    """Triton version of gpu_worker.executor.ops.torch_ops.paged_attention (same arguments, same result). Every sequence's
    keys and values, this step's included, must already be in the cache."""
    op = "paged_attention"
    check_launch(op, _paged_attention_kernel, query=query, key_cache=key_cache, value_cache=value_cache,
                 block_tables=block_tables, query_start_loc=query_start_loc, context_lens=context_lens)
    check_float(op, query=query, key_cache=key_cache, value_cache=value_cache)
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"{op}: query must be [T, Hq, D] and key_cache [num_blocks, block_size, Hkv, D]; "
                         f"got {tuple(query.shape)} and {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"{op}: value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match "
                         f"key_cache {tuple(key_cache.shape)} {key_cache.dtype}")
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: query has {num_q_heads} heads of dim {head_dim}, the cache {num_kv_heads} of "
                         f"dim {cache_head_dim}: head dims must match and Hq be a multiple of Hkv")
    num_seqs = context_lens.shape[0]
    for name, t, shape in (("block_tables", block_tables, (num_seqs, block_tables.shape[-1])),
                           ("query_start_loc", query_start_loc, (num_seqs + 1,)),
                           ("context_lens", context_lens, (num_seqs,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be a contiguous int32 tensor of shape {shape}; "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    check_last_dim_contiguous(op, query=query, key_cache=key_cache, value_cache=value_cache)

    out = torch.empty_like(query)  # [T, Hq, D]
    if num_tokens == 0 or num_seqs == 0:
        return out
    interpret = interpreted(_paged_attention_kernel)
    group = num_q_heads // num_kv_heads
    group_pad, head_pad = next_pow2(group), max(16, next_pow2(head_dim))  # tl.dot needs dims >= 16
    decode = num_tokens == num_seqs  # one token per sequence (the kernel is exact for any split)
    # float32 runs its dots on CUDA cores: small tiles keep it in registers (no spills on sm_90)
    narrow = interpret or query.dtype == torch.float32
    block_n = 16 if narrow else (64 if decode else 32)
    num_tiles = triton.cdiv(block_tables.shape[1] * block_size, block_n)  # bound on any sequence's tiles
    if decode:
        block_q, block_m = 1, max(16, group_pad)
        num_q_blocks = num_tokens
        splits = _num_splits(query.device, num_tokens * num_kv_heads, num_tiles, interpret)
    else:
        block_m = max(16 if narrow else 64, group_pad)
        block_q = block_m // group_pad
        num_q_blocks = num_tokens // block_q + num_seqs
        splits = 1
    tiles_per_split = triton.cdiv(num_tiles, splits)
    splits = triton.cdiv(num_tiles, tiles_per_split)
    dot_fp32 = query.dtype == torch.float32 or (interpret and query.dtype == torch.bfloat16)
    if splits > 1:  # part_acc: [T, Hq, splits, HEAD_PAD]; part_max / part_sum: [T, Hq, splits]
        part_acc = torch.empty(num_tokens, num_q_heads, splits, head_pad, dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, splits)](
        out, part_acc, part_max, part_sum,
        query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
        scale * _LOG2E, num_seqs, splits, tiles_per_split,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLIT=splits > 1, DOT_FP32=dot_fp32, num_warps=4, num_stages=2 if narrow else 3,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_max, part_sum, splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLITS_PAD=max(2, next_pow2(splits)), num_warps=4,
        )
    return out

