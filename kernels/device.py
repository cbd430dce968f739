"""Where a Triton kernel runs: CUDA tensors, or CPU tensors under the Triton interpreter.

The interpreter is chosen when a kernel is decorated (`TRITON_INTERPRET=1` must be set before
`triton` and `kernels` are imported), so each kernel object itself says how it will run.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs on the CPU through numpy)."""
    return isinstance(kernel, InterpretedFunction)


def check_launch(op: str, kernel, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that `kernel` can run on; returns that device."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"{op}: all tensors must be on one device; got {where}")
    device = devices.pop()
    if device.type != "cuda" and not interpreted(kernel):
        raise RuntimeError(
            f"{op}: the Triton kernels need CUDA tensors, got {device}. To run them on the CPU, set "
            "TRITON_INTERPRET=1 before triton or kernels is imported (or use the torch ops in gpu_worker.executor.ops.torch_ops)"
        )
    return device


def check_float(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_last_dim_contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dimension, got strides {t.stride()}"
                             f" (call .contiguous() first)")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
