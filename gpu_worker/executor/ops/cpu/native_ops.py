"""The model's hot ops on CPU through the native kernels (kernels.py, built from csrc/), with the signatures
and results of the `Ops` protocol (gpu_worker/executor/ops): select_ops takes these on CPU when the kernels
build. Any input a
kernel does not cover (another dtype, odd strides) goes to the torch op.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.executor.ops import torch_ops
from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu.kernels import SUFFIX, as_index, kernel


def _rows_ok(x: torch.Tensor) -> bool:
    """A CPU tensor of a kernel dtype whose rows are contiguous (any row stride)."""
    return x.device.type == "cpu" and x.dtype in SUFFIX and x.dim() == 2 and x.stride(1) == 1


def store_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """ops.store_kv_cache: key, value [T, Hkv, D] -> their slots (-1 skips)."""
    num_tokens = key.shape[0]
    k2, v2 = key.reshape(num_tokens, -1), value.reshape(num_tokens, -1)  # views when rows are contiguous
    layout = cpu_kernels.kv_layout(key_cache, value_cache)
    if not (_rows_ok(k2) and _rows_ok(v2) and key_cache.dtype == key.dtype == value.dtype and layout is not None
            and key.shape[1:] == value.shape[1:] == key_cache.shape[2:]):
        return torch_ops.store_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    slots = as_index(slot_mapping)
    kernel("store_kv", key.dtype)(k2.data_ptr(), k2.stride(0), v2.data_ptr(), v2.stride(0), key_cache.data_ptr(),
                                   value_cache.data_ptr(), slots.data_ptr(), num_tokens, key_cache.shape[2],
                                   key_cache.shape[3], key_cache.shape[1], layout)


def rms_norm(x, weight, eps, residual=None):
    """ops.rms_norm: normed, or (normed, x + residual) when residual is given."""
    if not (_rows_ok(x) and x.is_contiguous() and weight.dtype == x.dtype and weight.is_contiguous()
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))):
        return torch_ops.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)  # [T, H]
    new_residual = torch.empty_like(x) if residual is not None else None  # [T, H]
    kernel("rms_norm", x.dtype)(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                                out.data_ptr(), 0 if new_residual is None else new_residual.data_ptr(),
                                x.shape[0], x.shape[1], float(eps))
    return out if residual is None else (out, new_residual)


def silu_and_mul(x):
    """ops.silu_and_mul: x [T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""
    if not (_rows_ok(x) and x.is_contiguous()):
        return torch_ops.silu_and_mul(x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)  # [T, I]
    kernel("silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.shape[0], inter)
    return out


def rotary_embedding(positions, query, key, cos_sin_cache, head_dim, is_neox=True):
    """ops.rotary_embedding: query [T, Hq * D], key [T, Hkv * D] (row strides allowed) -> rotated copies."""
    if not (_rows_ok(query) and _rows_ok(key) and key.dtype == query.dtype == cos_sin_cache.dtype
            and cos_sin_cache.is_contiguous() and head_dim % 2 == 0):
        return torch_ops.rotary_embedding(positions, query, key, cos_sin_cache, head_dim, is_neox)
    pos = as_index(positions)
    q_out, k_out = torch.empty(query.shape, dtype=query.dtype), torch.empty(key.shape, dtype=key.dtype)
    kernel("rotary", query.dtype)(pos.data_ptr(), query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
                                  cos_sin_cache.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), query.shape[0],
                                  query.shape[1] // head_dim, key.shape[1] // head_dim, head_dim, int(is_neox))
    return q_out, k_out


@dataclass
class _AttentionPlan:
    """What paged_attention needs to know about a step's batch, worked out once per forward (not per layer)."""

    decode_rows: torch.Tensor | None  # [S_d] int64: query row of each decode sequence
    decode_tables: torch.Tensor | None  # [S_d, max_blocks] int32
    decode_lens: torch.Tensor | None  # [S_d] int32
    max_decode_len: int
    prefills: list[tuple[int, int, int]]  # (sequence, first row, context_len) of each chunk of 2+ tokens
    starts: list[int]
    tables: torch.Tensor  # [S, max_blocks] int32


_plans = threading.local()  # per forward thread: (block_tables, query_start_loc, context_lens, plan)


def _plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor) -> _AttentionPlan:
    """Every layer of a forward passes the same metadata tensors: the plan is kept for them."""
    last = getattr(_plans, "last", None)
    if last is not None and last[0] is block_tables and last[1] is query_start_loc and last[2] is context_lens:
        return last[3]
    starts, ctx = query_start_loc.tolist(), context_lens.tolist()
    decode = [s for s in range(len(ctx)) if starts[s + 1] - starts[s] == 1]
    tables = as_index(block_tables, torch.int32)
    rows = lens = decode_tables = None
    if len(decode) == len(ctx):
        rows, lens, decode_tables = as_index(query_start_loc[:-1]), as_index(context_lens, torch.int32), tables
    elif decode:
        sel = torch.tensor(decode, dtype=torch.long)
        rows = as_index(query_start_loc[:-1][sel])
        lens, decode_tables = as_index(context_lens[sel], torch.int32), tables[sel]
    plan = _AttentionPlan(rows, decode_tables, lens, max((ctx[s] for s in decode), default=0),
                          [(s, starts[s], ctx[s]) for s in range(len(ctx)) if starts[s + 1] - starts[s] > 1],
                          starts, tables)
    _plans.last = (block_tables, query_start_loc, context_lens, plan)
    return plan


def paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale):
    """ops.paged_attention: decode tokens (one query each) through the native decode kernel, each prefill chunk
    through the native causal flash kernel, both straight from the cache."""
    layout = cpu_kernels.kv_layout(key_cache, value_cache)
    if not (query.device.type == "cpu" and query.dtype in SUFFIX and key_cache.dtype == query.dtype
            and layout is not None):
        return torch_ops.paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                         context_lens, scale)
    plan = _plan(block_tables, query_start_loc, context_lens)
    query = query.contiguous()
    out = torch.empty_like(query)  # [T, Hq, D]
    if plan.decode_rows is not None:
        cpu_kernels.decode_attention(query, key_cache, value_cache, plan.decode_tables, plan.decode_lens,
                                     plan.decode_rows, scale, out, plan.max_decode_len)
    for s, start, ctx in plan.prefills:
        end = plan.starts[s + 1]
        if not kernel("prefill_attention", query.dtype)(
                query[start].data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), plan.tables[s].data_ptr(),
                ctx, end - start, query.shape[1], key_cache.shape[2], query.shape[2], key_cache.shape[1], layout,
                float(scale), out[start].data_ptr()):  # no native kernel for this head dim / CPU: torch's SDPA
            out[start:end] = prefill_attention(query[start:end], key_cache, value_cache, block_tables[s], ctx, scale)
    return out


# For the kernel dtypes it reads only slots this or earlier steps wrote (decode: masked per block; prefill:
# sliced to the context), so the runner need not zero fresh blocks for it.
paged_attention.reads_only_written_slots = SUFFIX.__contains__  # (dtype) -> bool


def prefill_attention(
    query: torch.Tensor,  # [q_len, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [nb]
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """One prefill chunk (positions [context_len - q_len, context_len), causal) through torch's CPU flash
    attention (where the native kernel has no variant), which it takes only for 4-D inputs with as many key heads as query heads (3-D or enable_gqa
    inputs go to the unfused math path, ~10x slower at these sizes)."""
    q_len, num_heads, _ = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    ids = block_table[: -(-context_len // block_size)].long()
    keys = key_cache.index_select(0, ids).flatten(0, 1)[:context_len]  # [ctx, Hkv, D]
    values = value_cache.index_select(0, ids).flatten(0, 1)[:context_len]
    if num_kv_heads != num_heads:
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, Hq, D]
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
    q = query.transpose(0, 1)[None]  # [1, Hq, q_len, D]
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, Hq, ctx, D]
    if context_len == q_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # bottom-right aligned causal mask: [q_len, ctx]
        q_pos = torch.arange(context_len - q_len, context_len)
        mask = torch.arange(context_len)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [q_len, Hq, D]


def cpu_ops() -> dict[str, object]:
    """name -> function for the ops namespace of a CPU model; empty where the kernels do not build."""
    if cpu_kernels.load() is None:
        return {}
    return {"store_kv_cache": store_kv_cache, "rms_norm": rms_norm, "silu_and_mul": silu_and_mul,
            "rotary_embedding": rotary_embedding, "paged_attention": paged_attention}
