"""kvfleet's native CPU kernels (csrc/: cpu_kernels.cpp and its parts): compiled once per machine, called
through ctypes.

torch's CPU path pays twice where these do not: decode attention gathers every sequence's blocks into a
contiguous copy (the whole KV cache moves through memory three times a step), and each elementwise op of a
layer (RMSNorm, rotary, SiLU-and-mul, KV store) is several torch ops, each a pass over memory and an OpenMP
barrier. The C++ (no torch headers) is compiled on first use with the system's g++ (-O3 -march=native, a few
seconds; KVFLEET_CPU_MARCH names an older CPU's -march instead, to run its code paths here: native_build) into
~/.cache/kvfleet/cpu_kernels/<hash of source, flags and CPU>/ and loaded with ctypes; its OpenMP loops run on
torch's own OpenMP runtime (same soname, already loaded), so torch.set_num_threads governs them too.
Without a compiler `load()` returns None and the model keeps the torch ops. On CPUs with AMX (Sapphire Rapids
and later) the bfloat16 panel GEMM and prefill attention multiply on AMX tiles (`amx()`), once Linux lends the
process the tile state.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from gpu_worker.executor.ops.cpu.native_build import FLAGS, build_library, check_march, source
from shared.settings import Settings

log = logging.getLogger(__name__)

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # dtypes with kernels

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "decode_attention": [_P, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _F, _I32, _P, _I32],
    "rms_norm": [_P, _P, _P, _P, _P, _I64, _I64, _F],
    "silu_and_mul": [_P, _P, _I64, _I64],
    "rotary": [_P, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32],
    "store_kv": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32],
    "prefill_attention": [_P, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _F, _P],
    # layers, num_layers, shape, hidden, residual, rows, positions, cos_sin, slots, block tables, their stride,
    # context lens, seconds per op kind (or NULL): decode_stack.py
    "decode_layers": [_P, _I32, _P, _P, _P, _I64, _P, _P, _P, _P, _I64, _P, _P],
}
_RESTYPES = {"prefill_attention": ctypes.c_int}  # 1: done, 0: no kernel for this shape (use torch)
# the panel GEMM: float32 (kvf_gemm_available() is 0 where the CPU has no AVX2 + FMA) and bfloat16
# (kvf_gemm_bf16_available(): AVX512_BF16)
_GEMM_SIGNATURES = {
    "kvf_isa": ([], ctypes.c_int),
    "kvf_prefill_covers": ([_I32], ctypes.c_int),
    "kvf_argmax_f32": ([_P, _I64, _I64, _I64, _P], ctypes.c_int),
    "kvf_gemm_available": ([], ctypes.c_int),
    "kvf_gemm_panel_width": ([], ctypes.c_int),
    "kvf_gemm_bf16_available": ([], ctypes.c_int),
    "kvf_amx": ([_I32], ctypes.c_int),
    "kvf_gemm_blocking": ([_I32], ctypes.c_int),
    "kvf_gemm_slice": ([_I32], ctypes.c_int),
    "kvf_gemm_packed_size_bf16": ([_I64, _I64], _I64),
    "kvf_gemm_pack_bf16": ([_P, _I64, _I64, _P], None),
    "kvf_gemm_bf16": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I32], None),
    "kvf_gemm_packed_size": ([_I64, _I64], _I64),
    "kvf_gemm_pack_f32": ([_P, _I64, _I64, _P], None),
    "kvf_gemm_f32": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64], None),
}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_march = "native"  # the -march of the loaded library


def load() -> ctypes.CDLL | None:
    """The compiled kernels (built once per machine, source and -march), or None where they cannot be built.
    ValueError where KVFLEET_CPU_MARCH names an -march the compiler rejects or this CPU cannot run."""
    global _lib, _tried, _march
    with _lock:
        if _tried:
            return _lib
        march = Settings.from_env().cpu_march
        if march != "native":
            check_march(march)  # raises before anything is built; a later call checks again
        _tried, _march = True, march
        try:
            lib = ctypes.CDLL(str(build_library(source(), [*FLAGS, f"-march={march}"], "cpu_kernels")))
        except (OSError, RuntimeError) as e:
            log.warning("kvfleet's CPU kernels are unavailable (%s); using the slower torch ops", e)
            return None
        for name, argtypes in _SIGNATURES.items():
            for suffix in SUFFIX.values():
                fn = getattr(lib, f"kvf_{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
        for name, (argtypes, restype) in _GEMM_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _lib = lib
        return lib


_functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}


def kernel(name: str, dtype: torch.dtype):
    """The compiled function `name` for tensors of `dtype` (load() must have succeeded)."""
    fn = _functions.get((name, dtype))
    if fn is None:
        assert _lib is not None, "cpu_kernels.load() first"
        fn = _functions[name, dtype] = getattr(_lib, f"kvf_{name}_{SUFFIX[dtype]}")
    return fn


def isa() -> str:
    """The instruction sets the compiled kernels use, e.g. "avx512+avx512_bf16", "avx2", "scalar"; "none"
    where they do not build."""
    lib = load()
    if lib is None:
        return "none"
    bits = lib.kvf_isa()
    names = [n for bit, n in ((2, "avx512"), (4, "avx512_bf16")) if bits & bit] or (["avx2"] if bits & 1 else [])
    return "+".join(names) or "scalar"


def describe() -> str:
    """isa(), and the -march where it is not native, for the start log: "avx2 (-march=x86-64-v3)"."""
    text = isa()
    return text if _march == "native" or text == "none" else f"{text} (-march={_march})"


def prefill_covers(head_dim: int) -> bool:
    """Has the compiled library a native prefill attention kernel for this head dim (else torch's SDPA)?"""
    lib = load()
    return lib is not None and bool(lib.kvf_prefill_covers(head_dim))


def as_index(t: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """t as a contiguous tensor of `dtype` (itself when it already is one)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def kv_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int | None:
    """How a layer's caches, both [num_blocks, block_size, Hkv, D], lie in memory: 0 token-major (contiguous), 1
    head-major (a contiguous [num_blocks, Hkv, block_size, D] seen through that shape: the CPU model runner's,
    each head's rows of a block side by side), None otherwise (the native kernels take neither; the torch ops
    do)."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        return None
    _, block_size, heads, dim = key_cache.shape
    if key_cache.stride() == (block_size * heads * dim, heads * dim, dim, 1):
        return 0
    if key_cache.stride() == (block_size * heads * dim, dim, block_size * dim, 1):
        return 1
    return None


def head_major_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                        dtype: torch.dtype) -> torch.Tensor:
    """A layer's key (or value) cache for the CPU: [num_blocks, block_size, Hkv, D] as every op indexes it, head-major
    in memory (kv_layout 1). Decode attention reads a block one head at a time: here each head's rows are one run
    (2 KiB at head dim 64 in bfloat16) where token-major gives 16 runs of 128 bytes. 2-core Zen 5, 64 sequences of
    200-440 tokens, 30 layers' caches from memory: bfloat16 11.2-11.8 ms a step against 11.8-12.4, float32
    23.4-23.7 against 25.0-26.3. Left uninitialised, as torch.empty."""
    return torch.empty(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype).transpose(1, 2)


def decode_attention(
    query: torch.Tensor,  # [T, Hq, D] contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], token- or head-major (kv_layout)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    rows: torch.Tensor,  # [S]: the query row (and output row) of each sequence's single token
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: rows `rows` are written
    max_context_len: int,
    simd: bool = True,  # False: the portable loops even where the AVX-512 / AVX2 kernel applies (tests)
) -> None:
    """Single-token attention of S sequences over their paged keys/values, straight from the cache."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    layout = kv_layout(key_cache, value_cache)
    assert query.is_contiguous() and out.is_contiguous() and layout is not None
    assert num_heads % num_kv_heads == 0 and out.dtype == query.dtype == key_cache.dtype
    tables, lens, rows = as_index(block_tables, torch.int32), as_index(context_lens, torch.int32), as_index(rows)
    kernel("decode_attention", query.dtype)(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), rows.data_ptr(), rows.shape[0], num_heads, num_kv_heads, head_dim, block_size, layout,
        float(scale), max(1, max_context_len), out.data_ptr(), int(simd))


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """x [N, V] float32 (rows with unit column stride) -> [N] int64, each row's argmax as torch's (the first
    of tied maxima; the first NaN where a row has one), rows split over torch's threads; None where this build
    has no AVX-512 (torch's argmax then)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or load() is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    return out if _lib.kvf_argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr()) else None


def gemm_available(dtype: torch.dtype = torch.float32) -> bool:
    """Is the panel GEMM compiled in for dtype? float32: the kernels load and the CPU has AVX2 + FMA;
    bfloat16: AVX512_BF16 (vdpbf16ps; on AMX tiles where `amx()`)."""
    if load() is None:
        return False
    if dtype == torch.bfloat16:
        return bool(_lib.kvf_gemm_bf16_available())
    return dtype == torch.float32 and bool(_lib.kvf_gemm_available())


def amx(use: bool | None = None) -> bool:
    """Do the bfloat16 panel GEMM (for k a multiple of 32) and prefill attention (head dims a multiple of 32)
    multiply on AMX tiles here: built with AMX-BF16, and Linux lends the process the tile state? Else on
    vdpbf16ps. use=False / True turns the tiles off / on again (to compare the two)."""
    if load() is None:
        return False
    return bool(_lib.kvf_amx(-1 if use is None else int(use)))


def gemm_blockings() -> tuple[str, str]:
    """The float32 panel GEMM's two k blockings in words (gemm_blocking's 0 and 1): the slice of k that stays in
    L1 while every row tile uses it, and where the next slice is prefetched to."""
    kc = [_lib.kvf_gemm_slice(b) if load() is not None else 0 for b in (0, 1)]  # from the build (0: none)
    return f"k{kc[0]}, next slice to L1", f"k{kc[1]}, next slice to L2"


def gemm_blocking(which: int | None = None) -> int:
    """The float32 panel GEMM's k blocking in use (0 or 1, see gemm_blockings). which=0 / 1 sets it (process-wide;
    the calibration picks the faster on this CPU). Results are the same bits under both."""
    if load() is None:
        return 0
    return int(_lib.kvf_gemm_blocking(-1 if which is None else which))


def gemm_panel_width() -> int:
    """Output columns per panel of the packed layout: 48 in AVX-512 builds, 24 in AVX2 ones."""
    return int(_lib.kvf_gemm_panel_width()) if gemm_available() else 0


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the panel layout `gemm` reads. float32: [ceil(N / W), K, W], W = gemm_panel_width();
    bfloat16: [ceil(N / 48), 3, ceil(K / 2), 16, 2] (groups of 16 columns; a k pair per column). Zero-padded."""
    assert weight.dim() == 2 and gemm_available(weight.dtype)
    w = weight.detach().contiguous()
    n, k = w.shape
    if w.dtype == torch.bfloat16:
        packed = torch.empty(_lib.kvf_gemm_packed_size_bf16(n, k), dtype=torch.bfloat16)
        _lib.kvf_gemm_pack_bf16(w.data_ptr(), n, k, packed.data_ptr())
        return packed
    packed = torch.empty(_lib.kvf_gemm_packed_size(n, k), dtype=torch.float32)
    _lib.kvf_gemm_pack_f32(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
         float_out: bool = False) -> torch.Tensor:
    """x [M, K] @ the packed weight [N, K]^T (+ bias [N]) -> [M, N], in the packed weight's dtype (float32 or
    bfloat16, x the same), on this thread (or on torch's threads when it has several and the weight is big).
    float_out: float32 whatever the dtype (a bfloat16 GEMM's results rounded to bfloat16 all the same, as
    `gemm(...).float()` gives them, written once)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32 if float_out else packed.dtype)
    if bias is not None:
        bias = bias.to(packed.dtype).contiguous()
    args = (x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(),
            out.data_ptr(), n)
    if packed.dtype == torch.bfloat16:
        _lib.kvf_gemm_bf16(*args, int(float_out))
    else:
        _lib.kvf_gemm_f32(*args)
    return out
