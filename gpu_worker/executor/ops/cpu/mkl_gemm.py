"""MKL's packed float32 GEMM (cblas_sgemm_pack / cblas_sgemm_compute), from the MKL inside torch's CPU library.

torch's x86 wheels link MKL into libtorch_cpu.so and export its CBLAS functions. F.linear calls MKL's sgemm,
which packs the weight into its own panel layout again on every call; packed once at load, the weight goes
straight into the kernel. torch has the same thing (`torch.ops.mkl._mkl_linear`), but it takes the packed form
only for the one row count it was packed for and falls back to F.linear for any other, and a prefill chunk's
row count changes every step. Called here, the packed weight serves any row count (`cblas_sgemm_pack_get_size`
is the same for 64 and 2,048 rows), but the packing is tuned for the row count it is given: one thread, the four
matmuls of a SmolLM2-135M layer in turn (2-core Xeon with AMX, family 6 model 167), packed for 512 rows: 162-173
GFLOP/s at 300, 512 and 1,024 rows against 151-157 for F.linear; packed for 1 or 64 rows: 148-161, no gain. The
results are F.linear's to the bit from a few rows on. The pack buffer is about 3 x the weight's bytes, of
which MKL writes (and the process keeps resident) about a third: the weight's own size.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162  # mkl_cblas.h
_I, _P = ctypes.c_int, ctypes.c_void_p


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's CPU library with MKL's packed-GEMM functions, or None (a torch without MKL: not x86, or a
    source build without it)."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [_I, _I, _I, _I]
    pack.argtypes = [_I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I, _P]
    compute.argtypes = [_I, _I, _I, _I, _I, _I, _P, _I, _P, _I, ctypes.c_float, _P, _I]
    return lib


def available() -> bool:
    return _mkl() is not None


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [N, K] float32 -> MKL's packed form of weight.T (uint8, opaque), for `gemm`: tuned for inputs of
    about `rows` rows, right for any number."""
    lib = _mkl()
    if lib is None:
        raise RuntimeError("MKL's packed GEMM is not in this torch build")
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"weight: a 2-D float32 tensor is packed, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().contiguous()
    n, k = w.shape
    # a fresh anonymous mapping, not malloc: MKL asks for ~3 x the weight's bytes and writes ~1 x, and only the
    # pages it writes become resident (from the heap, pages that earlier tensors touched would stay so: the
    # bench's peak RSS rose 0.7 GiB for SmolLM2 in float32)
    size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, rows, n, k)
    packed = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
    lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, rows, n, k, 1.0, w.data_ptr(), k, packed.data_ptr())
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 @ weight.T (+ bias) -> [M, N]; packed: `pack_weight(weight)`, weight [N, K]. Runs on
    the calling thread's OpenMP thread count, as F.linear does."""
    if x.dtype != torch.float32:
        raise ValueError(f"x: float32 expected, got {x.dtype}")
    m, k = x.shape
    if x.stride(1) != 1 or x.stride(0) < k:
        x = x.contiguous()
    # with a bias, C starts as the bias and MKL adds the product to it (beta 1), as F.linear's addmm does
    out = torch.empty(m, n, dtype=torch.float32)
    if bias is not None:
        out.copy_(bias.expand(m, n))  # a copy: expand(1, n).contiguous() would be the bias itself
    if m:
        _mkl().cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), x.stride(0),
                                   packed.data_ptr(), k, 0.0 if bias is None else 1.0, out.data_ptr(), n)
    return out
