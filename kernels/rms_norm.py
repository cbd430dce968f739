"""RMSNorm with an optional fused residual add, as Hugging Face computes it (float32 statistics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import check_float, check_last_dim_contiguous, check_launch, next_pow2


@triton.jit
def _rms_norm_kernel(
    out_ptr, new_residual_ptr, x_ptr, residual_ptr, weight_ptr, eps, hidden,
    stride_xt, stride_rt, stride_ot, stride_nt,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    # arithmetic in float32, rounded to the tensors' dtypes where torch rounds
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + offs, mask=mask, other=0.0).to(tl.float32)
        x = (xf + r).to(x.dtype)
        tl.store(new_residual_ptr + t * stride_nt + offs, x, mask=mask)
        xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of gpu_worker.executor.ops.torch_ops.rms_norm: out, or (out, x + residual) when residual is given."""
    op = "rms_norm"
    tensors = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    check_launch(op, _rms_norm_kernel, **tensors)
    check_float(op, **tensors)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"{op}: x must be [T, H] and weight [H]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{op}: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    check_last_dim_contiguous(op, **tensors)
    num_tokens, hidden = x.shape
    out = torch.empty(num_tokens, hidden, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)  # [T, H]
    new_residual = torch.empty_like(x) if residual is not None else out  # [T, H]
    if num_tokens:
        block_h = next_pow2(hidden)
        _rms_norm_kernel[(num_tokens,)](
            out, new_residual, x, x if residual is None else residual, weight, eps, hidden,
            x.stride(0), x.stride(0) if residual is None else residual.stride(0), out.stride(0),
            new_residual.stride(0), HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
            num_warps=min(16, max(1, block_h // 256)),
        )
    return out if residual is None else (out, new_residual)
