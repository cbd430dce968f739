"""kernels.paged_attention against gpu_worker.executor.ops.torch_ops.paged_attention: decode (with and without context
splits), prefill, chunked prefill after cached blocks, mixed batches, GQA, padded and shuffled block
tables, lengths of one token and lengths that end mid-block."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops
from kernels import paged_attention

pytestmark = pytest.mark.kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_batch(q_lens, ctx_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
               pad=-1, seed=0):
    """Random query and paged K/V; physical blocks shuffled, block tables padded with `pad`."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold unrelated data
    order = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(ctx_lens), max(blocks_per_seq) + 1), pad, dtype=torch.int32)  # [S, nb]
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=g).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=g).to(dtype)  # [T, Hq, D]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    args = (query, key_cache, value_cache, block_tables, query_start_loc, context_lens)
    return tuple(t.to(device) for t in args) + (head_dim**-0.5,)


def check(assert_close, args):
    expected = ops.paged_attention(*args)
    actual = paged_attention(*args)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(4, 2, 64, 16), (2, 2, 128, 8)])
def test_decode(device, assert_close, dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    # 3 seqs x 2 KV heads is few programs: the context is split and merged (one split is left empty)
    args = make_batch([1, 1, 1], [1, 17, 40], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size, dtype=dtype, device=device)
    check(assert_close, args)


def test_decode_many_seqs_unsplit_zero_padded(device, assert_close):
    ctx = [3, 16, 33, 1, 20, 47, 9, 32]  # 8 seqs x 2 KV heads: enough programs, no split
    args = make_batch([1] * 8, ctx, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.float16, device=device, pad=0, seed=1)
    check(assert_close, args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunked_and_decode_mixed(device, assert_close, dtype):
    # a fresh prompt, a decode token, and a chunk continuing after 18 cached tokens; GQA group of 3
    args = make_batch([5, 1, 12], [5, 20, 30], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=dtype, device=device, seed=2)
    check(assert_close, args)


def test_prefill_long_chunk_multi_tile(device, assert_close):
    # 37 query tokens over 45 keys: several query blocks and key tiles; block size 4; no GQA
    args = make_batch([37, 2], [45, 2], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=4,
                      dtype=torch.float16, device=device, seed=3)
    check(assert_close, args)


def test_as_many_tokens_as_seqs_but_uneven(device, assert_close):
    # T == S takes the decode launch; it must still handle a 2-token chunk next to an empty sequence
    args = make_batch([2, 0, 1], [9, 4, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.float32, device=device, seed=4)
    check(assert_close, args)


def test_strided_query_view(device, assert_close):
    # the model slices q out of a fused qkv projection: a view whose token stride is not Hq * D
    query, *rest = make_batch([3, 1], [3, 6], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                              dtype=torch.float16, device=device, seed=5)
    qkv = torch.randn(query.shape[0], 8 * 64, dtype=query.dtype, device=device)
    qkv[:, : 4 * 64] = query.reshape(query.shape[0], -1)
    check(assert_close, (qkv[:, : 4 * 64].view(-1, 4, 64), *rest))


def test_rejects_bad_inputs(device):
    query, key_cache, value_cache, block_tables, qsl, ctx, scale = make_batch(
        [1], [5], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=device)
    with pytest.raises(ValueError, match="block_tables must be a contiguous int32"):
        paged_attention(query, key_cache, value_cache, block_tables.long(), qsl, ctx, scale)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention(query[:, :3], key_cache, value_cache, block_tables, qsl, ctx, scale)
    with pytest.raises(ValueError, match="value_cache"):
        paged_attention(query, key_cache, value_cache.half(), block_tables, qsl, ctx, scale)
