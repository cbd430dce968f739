"""kernels.store_kv_cache against gpu_worker.executor.ops.torch_ops.store_kv_cache: shuffled slots, padded (-1) slots,
strided key/value views, a cache dtype different from the inputs'."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops
from kernels import store_kv_cache

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)])
def test_store_matches_torch(device, dtype, cache_dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 8, 3, 64, 9
    # key and value are views into a fused [T, (Hq + 2 Hkv) * D] projection, as the model makes them
    qkv = torch.randn(num_tokens, (2 + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    key = qkv[:, 2 * head_dim: (2 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (2 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 7]] = -1  # padded tokens are skipped
    slot_mapping = slots.to(device)  # [T] int64
    caches = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype).to(device)
    expected_k, expected_v = caches[0].clone(), caches[1].clone()
    ops.store_kv_cache(key, value, expected_k, expected_v, slot_mapping)
    key_cache, value_cache = caches[0].clone(), caches[1].clone()
    store_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    assert not torch.equal(key_cache, caches[0])  # something was written


def test_rejects_bad_slot_mapping(device):
    key = torch.randn(4, 2, 64, device=device)
    cache = torch.zeros(2, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous int64"):
        store_kv_cache(key, key, cache, cache.clone(), torch.arange(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="key_cache and value_cache"):
        store_kv_cache(key, key, cache[:, :, :1], cache[:, :, :1], torch.arange(4, device=device))
