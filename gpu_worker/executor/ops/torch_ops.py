"""Torch reference implementations of the model's hot operations (the `Ops` protocol of this package): the
ground truth the native CPU kernels and the Triton kernels are tested against, and the fallback for any input
they do not cover.
KV cache per layer: key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASKED = float("-inf")


def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    """Write each token's key/value into its slot (block_id * block_size + offset). The caches may be any strided
    view of that shape (the CPU runner's are head-major in memory)."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slot_mapping.div(block_size, rounding_mode="floor"), slot_mapping.remainder(block_size)
    key_cache.index_put_((blocks, offsets), key.to(key_cache.dtype))
    value_cache.index_put_((blocks, offsets), value.to(value_cache.dtype))


_DECODE_BUCKET_FILL = 0.75  # a decode group pads to its longest context; start a new group below this fill
_MAX_DECODE_GROUPS = 4


def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D], block_ids [S, nb] int64 -> [S, Hkv, nb * bs, D] (a strided view)."""
    num_seqs, nb = block_ids.shape
    g = cache.index_select(0, block_ids.flatten())  # [S * nb, bs, Hkv, D]
    return g.view(num_seqs, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _decode_attention(
    query: torch.Tensor,  # [S, Hq, D] one query token per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, nb] (only the columns needed)
    context_lens: torch.Tensor,  # [S]
    scale: float,
) -> torch.Tensor:
    """Single-token queries in one gather + batched SDPA; the G query heads sharing a KV head act as G
    query rows, so GQA needs no KV repeat."""
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    ids = block_tables.long().clamp_(min=0)
    keys = _gather_kv(key_cache, ids)  # [S, Hkv, L, D]
    values = _gather_kv(value_cache, ids)
    max_len = keys.shape[2]
    # mask: [S, 1, 1, L], True = attend
    mask = (torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None].long())[:, None, None, :]
    q = query.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [S, Hkv, G, D]
    out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_q_heads, head_dim)


def _decode_groups(seqs: list[int], ctx: list[int]) -> list[list[int]]:
    """Split decode sequences into a few groups of similar context length, so padding stays small."""
    order = sorted(seqs, key=lambda s: ctx[s], reverse=True)
    groups: list[list[int]] = [[]]
    longest = ctx[order[0]]
    for s in order:
        if groups[-1] and ctx[s] < _DECODE_BUCKET_FILL * longest and len(groups) < _MAX_DECODE_GROUPS:
            groups.append([])
            longest = ctx[s]
        groups[-1].append(s)
    return groups


def _prefill_attention(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [nb]
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """One prefill chunk: queries sit at positions [context_len - q_len, context_len), causal."""
    q_len, num_q_heads, head_dim = query.shape
    block_size = key_cache.shape[1]
    num_blocks = -(-context_len // block_size)
    ids = block_table[:num_blocks].long()[None]  # [1, nb]
    keys = _gather_kv(key_cache, ids)[0, :, :context_len]  # [Hkv, ctx, D]
    values = _gather_kv(value_cache, ids)[0, :, :context_len]
    q = query.transpose(0, 1)  # [Hq, q_len, D]
    if context_len == q_len:
        mask, causal = None, True
    else:  # bottom-right aligned causal mask: [q_len, ctx]
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
        mask = torch.arange(context_len, device=query.device)[None, :] <= q_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(
        q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=keys.shape[0] != num_q_heads,
    )
    return out.transpose(0, 1)  # [q_len, Hq, D]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32, padded with -1 or 0
    query_start_loc: torch.Tensor,  # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32, tokens incl. this step's
    scale: float,
) -> torch.Tensor:
    """Attention of every query token over its sequence's paged keys/values (stored before the call).

    Query i of sequence s sits at position context_lens[s] - q_len_s + i and attends causally.
    Decode tokens (q_len == 1) run batched; each prefill chunk runs one SDPA.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    ctx = context_lens.tolist()
    block_size = key_cache.shape[1]
    decode_seqs = [s for s in range(len(ctx)) if starts[s + 1] - starts[s] == 1]
    if decode_seqs:
        for group in _decode_groups(decode_seqs, ctx):
            if len(group) == len(ctx) and group == sorted(group):
                rows, sel = query_start_loc[:-1].long(), slice(None)
            else:
                sel = torch.tensor(group, dtype=torch.long, device=query.device)
                rows = query_start_loc[:-1].long()[sel]
            max_blocks = -(-ctx[group[0]] // block_size)
            out[rows] = _decode_attention(query[rows], key_cache, value_cache,
                                          block_tables[sel, :max_blocks], context_lens[sel], scale)
    for s in range(len(ctx)):
        start, end = starts[s], starts[s + 1]
        if end - start > 1:
            out[start:end] = _prefill_attention(query[start:end], key_cache, value_cache, block_tables[s],
                                                ctx[s], scale)
    return out


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as Hugging Face computes it (float32 statistics); with `residual`, add it first and return
    (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:  # one fused op, same result
        normed = F.rms_norm(x, weight.shape, weight, eps)
    else:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return normed if residual is None else (normed, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (gate | up) -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos | sin halves
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions (neox: rotate halves; otherwise interleaved pairs)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_dim)  # [T, H, D]
        if is_neox:
            x1, x2 = x.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.flatten(1)

    return rotate(query), rotate(key)
