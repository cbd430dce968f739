"""kernels.rms_norm against gpu_worker.executor.ops.torch_ops.rms_norm, with and without the fused residual add."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops
from kernels import rms_norm

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(device, assert_close, dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    num_tokens, hidden = 5, 96  # hidden not a power of two: the kernel masks its tail
    x = (3 * torch.randn(num_tokens, hidden, generator=g)).to(dtype).to(device)
    weight = torch.rand(hidden, generator=g).add(0.5).to(dtype).to(device)
    residual = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(device) if with_residual else None
    x_before = x.clone()
    expected = ops.rms_norm(x, weight, 1e-6, residual)
    actual = rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert_close(actual[0], expected[0])
        assert_close(actual[1], expected[1])  # x + residual (the interpreter rounds bf16 toward zero)
    else:
        assert_close(actual, expected)
    assert torch.equal(x, x_before)


def test_float32_weight_promotes_like_torch(device, assert_close):
    x = torch.randn(3, 64, device=device).to(torch.bfloat16)
    weight = torch.rand(64, device=device)
    expected = ops.rms_norm(x, weight, 1e-5)
    assert expected.dtype == torch.float32
    assert_close(rms_norm(x, weight, 1e-5), expected, torch.bfloat16)  # normed is rounded to bf16 first


def test_rejects_mismatched_residual(device):
    x = torch.randn(3, 64, device=device)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64, device=device), 1e-5, x.half())
