"""gpu_worker.executor.ops.torch_ops against naive dense computations."""

import math

import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops

pytestmark = pytest.mark.unit


def _naive_attention(q, k, v, q_positions, scale):
    """q [q, Hq, D], k/v [ctx, Hkv, D]: causal by absolute position, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_paged_attention_mixed_batch(hq, hkv):
    g = torch.Generator().manual_seed(0)
    block_size, head_dim, num_blocks = 4, 8, 40
    # (context_len, q_len): prefill from 0, chunk at an offset, decodes, a 1-token chunk
    seqs = [(7, 7), (3, 1), (13, 5), (9, 1), (1, 1), (16, 16)]
    key_cache = torch.zeros(num_blocks, block_size, hkv, head_dim)
    value_cache = torch.zeros_like(key_cache)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-c // block_size) for c, _ in seqs)
    tables, queries, full_kv, starts = [], [], [], [0]
    for ctx, q_len in seqs:
        nb = -(-ctx // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks + [-1] * (max_blocks - nb))
        k = torch.randn(ctx, hkv, head_dim, generator=g)
        v = torch.randn(ctx, hkv, head_dim, generator=g)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx)])
        ops.store_kv_cache(k, v, key_cache, value_cache, slots)
        full_kv.append((k, v))
        queries.append(torch.randn(q_len, hq, head_dim, generator=g))
        starts.append(starts[-1] + q_len)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_attention(torch.cat(queries), key_cache, value_cache,
                              torch.tensor(tables, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                              torch.tensor([c for c, _ in seqs], dtype=torch.int32), scale)
    for i, (ctx, q_len) in enumerate(seqs):
        k, v = full_kv[i]
        want = _naive_attention(queries[i], k, v, torch.arange(ctx - q_len, ctx), scale)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, atol=1e-5, rtol=1e-5)


def test_store_kv_cache_skips_negative_slots():
    kc = torch.zeros(2, 2, 1, 3)
    vc = torch.zeros_like(kc)
    k = torch.arange(9.0).view(3, 1, 3)
    ops.store_kv_cache(k, -k, kc, vc, torch.tensor([3, -1, 0]))
    assert kc.view(4, 3)[3].tolist() == [0.0, 1.0, 2.0]
    assert kc.view(4, 3)[0].tolist() == [6.0, 7.0, 8.0]
    assert kc.view(4, 3)[1:3].abs().sum() == 0
    assert vc.view(4, 3)[0].tolist() == [-6.0, -7.0, -8.0]


def test_rms_norm_with_residual():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    out, new_res = ops.rms_norm(x, w, 1e-6, r)
    s = x + r
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_silu_and_mul():
    x = torch.randn(5, 6)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :3]) * x[:, 3:])


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_rotates_pairs(is_neox):
    head_dim, positions = 4, torch.tensor([0, 3])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(8).float()[:, None] * inv_freq[None, :]  # [8, D/2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    q, k = torch.randn(2, 2 * head_dim), torch.randn(2, head_dim)
    q_out, k_out = ops.rotary_embedding(positions, q, k, cache, head_dim, is_neox)
    for x, y in ((q, q_out), (k, k_out)):
        x, y = x.view(2, -1, head_dim), y.view(2, -1, head_dim)
        for t, p in enumerate(positions.tolist()):
            for j in range(head_dim // 2):
                a, b = (j, j + head_dim // 2) if is_neox else (2 * j, 2 * j + 1)
                c, s = math.cos(p * inv_freq[j].item()), math.sin(p * inv_freq[j].item())
                torch.testing.assert_close(y[t, :, a], x[t, :, a] * c - x[t, :, b] * s)
                torch.testing.assert_close(y[t, :, b], x[t, :, b] * c + x[t, :, a] * s)
