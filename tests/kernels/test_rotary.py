"""kernels.rotary_embedding against gpu_worker.executor.ops.torch_ops.rotary_embedding: neox and interleaved layouts, positions
out of order, query/key as views of a fused projection, a float32 cache with half-precision inputs."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops
from kernels import rotary_embedding

pytestmark = pytest.mark.kernels


def cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D]


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotary_matches_torch(device, assert_close, dtype, cache_dtype, is_neox, head_dim):
    g = torch.Generator().manual_seed(0)
    num_tokens, num_q_heads, num_kv_heads = 6, 4, 2
    positions = torch.tensor([7, 0, 3, 100, 5, 6]).to(device)  # [T] int64
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
    query = qkv[:, : num_q_heads * head_dim]  # strided views, like the model's fused projection
    key = qkv[:, num_q_heads * head_dim: (num_q_heads + num_kv_heads) * head_dim]
    cache = cos_sin_cache(128, head_dim).to(cache_dtype).to(device)
    qkv_before = qkv.clone()
    expected_q, expected_k = ops.rotary_embedding(positions, query, key, cache, head_dim, is_neox)
    actual_q, actual_k = rotary_embedding(positions, query, key, cache, head_dim, is_neox)
    assert_close(actual_q, expected_q)
    assert_close(actual_k, expected_k)
    assert torch.equal(qkv, qkv_before)


def test_rejects_cache_of_wrong_width(device):
    q = torch.randn(2, 128, device=device)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        rotary_embedding(torch.arange(2, device=device), q, q, cos_sin_cache(16, 32).to(device), 64)
