"""How the model's linear layers run: which matmul path for how many rows, and the weights packed for it.

On CUDA, and for any weight without a packed form, it is F.linear. On CPU the fastest path depends on the CPU
and on the number of rows, so the model runner calls `calibrate` once, on one decoder weight, before any weight
is packed; the LinearPlan it returns is the runner's, and it packs every weight (`LinearPlan.pack`). Each
packed weight carries what the plan decided for it, so `linear` needs nothing else. `calibrate` measures on
one thread, as each of the model runner's forward threads runs:
- few rows (decode steps: each forward thread multiplies its share of the batch's sequences, tens of rows):
  oneDNN with a weight packed ahead of time, or kvfleet's panel GEMM (csrc/cpu_kernels.cpp, AVX2 + FMA).
  On a 2-core AMD Zen 3 at 32 rows, 30 layers' weights streaming from memory: panel 76, oneDNN 64 GFLOP/s.
- many rows (prefill chunks): F.linear (MKL's sgemm for float32) where it beats the few-rows path at
  CALIBRATION_ROWS (Zen 3: MKL ~7% over the panel GEMM, ~12% over oneDNN; Zen 4: oneDNN ~2x MKL, so it must
  be measured).
With P > 1 threads it also measures how a decode step should use them (`one_forward_below`): P concurrent
single-threaded calls, each with its share of the rows and each streaming the whole weight, or one call on
all P threads, which split the output columns, so that each streams 1 / P of it. 2-core machines, the
model's 30 layers streaming, a step of 64 rows: Zen 5 one call 52 against 62 ms (bfloat16 28 against 36);
Zen 4 level; Zen 3 (panel GEMM) 160 against 175.
bfloat16 weights: oneDNN's bf16 GEMM where the CPU has one (AVX-512 BF16 / AMX); elsewhere neither oneDNN nor
aten has a fast bf16 GEMM, and a float32 copy of each weight gives the same result (bf16 x bf16 products are
exact in float32, summed in float32 as a bf16 GEMM does) at float32 speed, for twice the weights' memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.executor.ops.cpu import kernels as cpu_kernels

log = logging.getLogger(__name__)

DECODE_ROWS = 32  # a forward thread's share of a decode batch of 64 sequences
CALIBRATION_ROWS = 512  # a forward thread's share of a prefill chunk; F.linear from half this many rows
STREAMED_BYTES = 64 << 20  # copies of the calibration weight to stream, more than a last-level cache holds


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] in the layout of one path, made once at load."""

    kind: str  # "onednn": oneDNN's blocked layout; "panel": cpu_kernels.pack_gemm_weight's panels
    data: torch.Tensor
    out_features: int
    upcast: bool  # a float32 form of a bfloat16 weight: bfloat16 inputs are multiplied in float32
    aten_from_rows: int | None = None  # float32 inputs of this many rows or more take F.linear; None: never


@dataclass(frozen=True)
class LinearPlan:
    """What `calibrate` chose on this CPU: the model runner holds it and packs its weights by it."""

    few_rows: str  # "onednn" | "panel": the packed layout, used below aten_from_rows
    aten_from_rows: int | None  # float32 inputs of this many rows or more take F.linear; None: never
    bf16_gemm: bool  # oneDNN multiplies bfloat16 natively here (else bf16 weights get a float32 form)
    one_forward_below: int = 0  # steps of fewer rows run as one forward on all threads (see splits_columns)

    def pack(self, weight: torch.Tensor) -> PackedWeight | None:
        """weight [N, K] packed for this plan (made once at load); None where F.linear is the way (CUDA,
        other dtypes, no oneDNN)."""
        if not _packable(weight):
            return None
        if weight.dtype == torch.bfloat16 and self.bf16_gemm:
            return _pack(weight, "onednn", upcast=False)
        upcast = weight.dtype == torch.bfloat16
        return _pack(weight, self.few_rows, upcast, None if upcast else self.aten_from_rows)

    def describe(self, dtype: torch.dtype) -> str:
        """The path in words, e.g. "oneDNN packed below 1024 rows, F.linear (MKL) from 1024"."""
        if dtype == torch.bfloat16:
            return ("oneDNN bf16 packed (native bf16 GEMM)" if self.bf16_gemm else
                    f"a float32 copy of each bf16 weight ({self.describe(torch.float32)}): no bf16 GEMM here")
        name = "oneDNN packed" if self.few_rows == "onednn" else "kvfleet's panel GEMM"
        if self.aten_from_rows:
            return f"{name} below {self.aten_from_rows} rows, F.linear (MKL) from {self.aten_from_rows}"
        return f"{name} for any number of rows"

    def splits_columns(self, num_rows: int) -> bool:
        """Does a step of num_rows rows run as one forward on all threads, each matmul splitting its output
        columns across them (each thread streams 1 / P of the weight, for all the rows), rather than as the
        model runner's P concurrent single-threaded forwards? Measured by `calibrate` for decode-sized steps;
        never for prefill chunks (2-core Zen 5, 2,048 rows through oneDNN: 1.38 against 1.33 s, the other
        way)."""
        return num_rows < self.one_forward_below


def _has_bf16_gemm(weight: torch.Tensor) -> bool:
    """Can oneDNN pack a bfloat16 weight here? (It needs AVX-512 BW at least.)"""
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight.detach()[:1].to(torch.bfloat16))
    except RuntimeError:
        return False
    return True


def _pack(weight: torch.Tensor, kind: str, upcast: bool, aten_from_rows: int | None = None) -> PackedWeight:
    """weight in the layout of `kind`; upcast: a float32 form of a bfloat16 weight."""
    w = weight.detach().float() if upcast else weight.detach()
    data = cpu_kernels.pack_gemm_weight(w) if kind == "panel" else torch.ops.mkldnn._reorder_linear_weight(w)
    return PackedWeight(kind, data, w.shape[0], upcast, aten_from_rows)


def _run(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    xx = x.float() if packed.upcast else x
    if packed.kind == "panel":
        out = cpu_kernels.gemm(xx, packed.data, packed.out_features, bias)
    else:
        b = bias.float() if packed.upcast and bias is not None else bias
        out = torch.ops.mkldnn._linear_pointwise(xx, packed.data, b, "none", [], "")
    return out.to(x.dtype) if packed.upcast else out


def _fastest(cases: dict[str, Callable[[], object]], rounds: int = 4) -> dict[str, float]:
    """name -> best seconds of one call, rounds interleaved (robust to a noisy neighbour)."""
    best = dict.fromkeys(cases, float("inf"))
    for fn in cases.values():
        fn()  # first calls allocate and pick kernels
    for _ in range(rounds):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


def _one_call_wins(packed: PackedWeight, weight: torch.Tensor, threads: int) -> bool:
    """Is one call of threads * DECODE_ROWS rows on `threads` threads faster than `threads` concurrent
    single-threaded calls of DECODE_ROWS rows each? Over copies of the weight that no cache holds, as a
    forward streams its layers' weights. The caller's thread runs on `threads` threads."""
    num_copies = min(16, -(-STREAMED_BYTES // packed.data.nbytes))
    copies = [packed] + [_pack(weight, packed.kind, packed.upcast) for _ in range(num_copies - 1)]
    rows = [torch.randn(DECODE_ROWS, weight.shape[1]).to(weight.dtype) for _ in range(threads)]
    both = torch.cat(rows)

    def each(x: torch.Tensor) -> None:
        with torch.inference_mode():
            for p in copies:
                _run(x, p, None)

    with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        def concurrent() -> None:
            for f in [pool.submit(each, x) for x in rows]:
                f.result()

        best = _fastest({"concurrent": concurrent, "one": lambda: each(both)})
    log.debug("decode-sized steps (%d x %d rows): one call %.2f ms, %d concurrent %.2f ms", threads,
              DECODE_ROWS, best["one"] * 1e3, threads, best["concurrent"] * 1e3)
    return best["one"] < best["concurrent"]


def calibrate(weight: torch.Tensor) -> LinearPlan | None:
    """Measure the paths on `weight` (a decoder layer's gate|up, [N, K]): the plan to pack this model's
    weights by. None where nothing is packed (not a CPU float32 / bfloat16 weight)."""
    if not _packable(weight):
        return None
    bf16_gemm = weight.dtype == torch.bfloat16 and _has_bf16_gemm(weight)
    upcast = weight.dtype == torch.bfloat16 and not bf16_gemm
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            few = {"onednn": _pack(weight, "onednn", upcast)}
            if cpu_kernels.gemm_available() and (weight.dtype == torch.float32 or upcast):
                few["panel"] = _pack(weight, "panel", upcast)
            choice = "onednn"
            if len(few) > 1:
                x = torch.randn(DECODE_ROWS, weight.shape[1]).to(weight.dtype)
                best = _fastest({name: (lambda p=p: _run(x, p, None)) for name, p in few.items()})
                choice = min(best, key=best.__getitem__)
            aten_from = None
            if weight.dtype == torch.float32:
                x = torch.randn(CALIBRATION_ROWS, weight.shape[1])
                best = _fastest({"aten": lambda: F.linear(x, weight), "packed": lambda: _run(x, few[choice], None)})
                aten_from = CALIBRATION_ROWS // 2 if best["aten"] < best["packed"] else None
    finally:
        torch.set_num_threads(threads)
    # decode-sized steps: below the rows where F.linear may take over (aten_from is None or this same bound)
    one_below = CALIBRATION_ROWS // 2 if threads > 1 and _one_call_wins(few[choice], weight, threads) else 0
    return LinearPlan(choice, aten_from, bf16_gemm, one_below)


def linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    packed: PackedWeight | None = None,  # LinearPlan.pack(weight)
) -> torch.Tensor:
    """x @ weight.T + bias -> [T, N], by the path the plan chose for this many rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.aten_from_rows is not None and x.shape[0] >= packed.aten_from_rows:
        return F.linear(x, weight, bias)
    return _run(x, packed, bias)
