"""Torch reference implementations of the model's hot operations (the CPU path).

kernels/ holds Triton versions with identical signatures; the model picks one namespace at construction.
KV cache per layer: key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import time

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
    """Write each token's key/value into its slot (block_id * block_size + offset)."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    flat_k = key_cache.view(num_slots, *key_cache.shape[2:])  # [num_slots, Hkv, D]
    flat_v = value_cache.view(num_slots, *value_cache.shape[2:])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


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


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] in oneDNN's blocked layout, made once at load (float32 and bfloat16 on CPU); None where
    F.linear is the way. Which float32 path is faster depends on the CPU: on AMD Zen 4 oneDNN's packed weight
    is about twice MKL's sgemm (F.linear) at these shapes; on Zen 3 MKL is ~12% faster from a few hundred rows
    on, oneDNN below. `calibrate_linear` measures it once per process."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:
        if weight.dtype != torch.bfloat16:
            raise
    # bfloat16 on a CPU without AVX-512 / AVX-NE-CONVERT: neither oneDNN nor aten has a fast bf16 GEMM there.
    # A float32 copy of the weight gives the same result (bf16 x bf16 products are exact in float32, summed
    # in float32 as a bf16 GEMM does) at float32 speed, for twice the weights' memory.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float())


CALIBRATION_ROWS = 512  # a prefill chunk's worth of rows; decode batches of a part stay far below
_aten_from_rows: int | None = None  # rows from which F.linear beats the packed weight (float32); None: never
_calibrated = False


def calibrate_linear(weight: torch.Tensor, packed: torch.Tensor | None) -> None:
    """Time F.linear against the packed weight at CALIBRATION_ROWS rows on one thread (as each of the model
    runner's forward threads runs), once per process; where F.linear is at least 5% faster, `linear` takes
    it for inputs of CALIBRATION_ROWS // 2 rows or more. bfloat16 F.linear is oneDNN already: nothing to do."""
    global _aten_from_rows, _calibrated
    if _calibrated or packed is None or weight.dtype != torch.float32:
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(CALIBRATION_ROWS, weight.shape[1], dtype=weight.dtype)  # [M, K]
        paths = {"aten": lambda: F.linear(x, weight),
                 "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
        best = dict.fromkeys(paths, float("inf"))
        with torch.inference_mode():
            for _ in range(4):  # interleaved rounds, the best of each: robust to a noisy neighbour
                for name, fn in paths.items():
                    t = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    _aten_from_rows = CALIBRATION_ROWS // 2 if best["aten"] < 0.95 * best["packed"] else None
    _calibrated = True


def linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    packed: torch.Tensor | None = None,  # pack_linear_weight(weight)
) -> torch.Tensor:
    """x @ weight.T + bias -> [T, N], through the packed weight when there is one (and it is the faster path
    for this many rows: calibrate_linear)."""
    if packed is not None and packed.dtype != x.dtype:  # a float32 copy of a bfloat16 weight (pack_linear_weight)
        out = torch.ops.mkldnn._linear_pointwise(x.float(), packed, None if bias is None else bias.float(),
                                                 "none", [], "")
        return out.to(x.dtype)
    if packed is not None and (_aten_from_rows is None or x.shape[0] < _aten_from_rows or x.dtype != torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
