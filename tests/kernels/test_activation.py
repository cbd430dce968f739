"""kernels.silu_and_mul against gpu_worker.executor.ops.torch_ops.silu_and_mul."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.executor.ops import torch_ops as ops
from kernels import silu_and_mul

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [80, 1100])  # a masked tail; several column blocks
def test_silu_and_mul_matches_torch(device, assert_close, dtype, inter):
    g = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(3, 2 * inter, generator=g)).to(dtype).to(device)
    assert_close(silu_and_mul(x), ops.silu_and_mul(x))


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        silu_and_mul(torch.randn(2, 7, device=device))
