"""SiLU-and-mul (SwiGLU): out = silu(gate) * up for x = [gate | up]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import check_float, check_last_dim_contiguous, check_launch, next_pow2


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded like torch's F.silu
    # the product of two half-precision values is exact in float32: one rounding, as torch does
    tl.store(out_ptr + t * stride_ot + offs, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of gpu_worker.executor.ops.torch_ops.silu_and_mul: x [T, 2 * I] (gate | up) -> [T, I]."""
    op = "silu_and_mul"
    check_launch(op, _silu_and_mul_kernel, x=x)
    check_float(op, x=x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"{op}: x must be [T, 2 * I]; got {tuple(x.shape)}")
    check_last_dim_contiguous(op, x=x)
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)  # [T, I]
    if num_tokens and inter:
        block = min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out, x, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out
