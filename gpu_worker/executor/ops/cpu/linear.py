"""How the model's linear layers run: which matmul path for how many rows, and the weights packed for it.

On CUDA, and for any weight without a packed form, it is F.linear. On CPU the fastest path depends on the CPU
and on the number of rows, so the model runner calls `calibrate` once, on one decoder weight, before any weight
is packed; the LinearPlan it returns is the runner's, and it packs every weight (`LinearPlan.pack`). Each
packed weight carries what the plan decided for it, so `linear` needs nothing else. `calibrate` measures on
one thread, as each of the model runner's forward threads runs:
- few rows (decode steps: tens of rows, every layer's weight read from memory once a step): oneDNN with a
  weight packed ahead of time, or kvfleet's panel GEMM (csrc/gemm_f32.h, gemm_bf16.h: float32 in 8 x 48
  AVX-512 tiles or 4 x 24 AVX2 ones; bfloat16 with AVX512_BF16 dot products), timed over copies of the weight
  that no cache holds. 2-core AMD Zen 3, float32, 32 rows: panel 76, oneDNN 64 GFLOP/s. 2-core Zen 5, the
  model's 30 layers and lm_head streaming, 64 rows on 2 threads: float32 panel ~410-430, oneDNN ~340-360;
  bfloat16 670 against 534. 2-core Xeon with AMX (family 6 model 167), the same: bfloat16 on AMX tiles 12.6 ms
  a step, oneDNN (also AMX) 13.4. The float32 panel GEMM is timed under each of its k blockings
  (cpu_kernels.gemm_blockings) and the faster is set for the process: on that Xeon, 32 rows on one thread,
  slices of 128 prefetched into L2 8.2-8.6 ms against 9.3-10.0 for slices of 256 prefetched into L1 (Zen 5's
  best).
- many rows (prefill chunks, MANY_ROWS rows or more): F.linear, oneDNN packed, the panel GEMM or (float32)
  MKL packed (mkl_gemm), whichever is fastest at CALIBRATION_ROWS through the layer's weights in turn, as a
  forward runs them (`_many_rows_cases`). float32: Zen 3 MKL ~7% over the panel GEMM, ~12% over oneDNN; Zen 5
  oneDNN 229, panel 212, MKL 99 GFLOP/s a thread; Xeon with AMX, a layer's four matmuls at 512 rows, MKL
  packed 131-181, F.linear 118-159, oneDNN 114-160. bfloat16, Zen 5: panel 455, oneDNN 446; Xeon with AMX:
  oneDNN 1,691, panel on AMX tiles 952.
  A weight whose two paths differ keeps the layout of each (one more copy of the weights in memory).
With P > 1 threads it also measures how a decode step should use them (`one_forward_below`): P concurrent
single-threaded calls, each with its share of the rows and each streaming the whole weight, or one call on
all P threads, which split the output columns, so that each streams 1 / P of it. 2-core machines, the
model's 30 layers streaming, a step of 64 rows (oneDNN): Zen 5 one call 52 against 62 ms (bfloat16 28
against 36); Zen 4 level; Zen 3 (panel GEMM) 160 against 175.
bfloat16 weights: a bf16 GEMM where the CPU has one (oneDNN's: AVX-512 BF16 / AMX; the panel GEMM's: AMX tiles
where the CPU has them, else AVX512_BF16); elsewhere neither oneDNN nor aten has a fast bf16 GEMM, and a float32
copy of each weight gives the same result (bf16 x bf16 products are exact in float32, summed in float32 as a bf16
GEMM does) at float32 speed, for twice the weights' memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu import mkl_gemm

log = logging.getLogger(__name__)

DECODE_ROWS = 32  # a forward thread's share of a decode batch of 64 sequences
CALIBRATION_ROWS = 512  # a forward thread's share of a prefill chunk
MANY_ROWS = CALIBRATION_ROWS // 2  # inputs of this many rows or more take the plan's many-rows path
MANY_COPIES = 4  # many rows are timed over this many copies of the weight in turn where no layer is given
STREAMED_BYTES = 64 << 20  # copies of the calibration weight to stream, more than a last-level cache holds
PATH_NAMES = {"onednn": "oneDNN packed", "panel": "kvfleet's panel GEMM", "aten": "F.linear (MKL)",
              "mkl": "MKL packed"}


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] in the layout of one path (two where few and many rows take different ones), made once
    at load."""

    kind: str  # "onednn": oneDNN's blocked layout; "panel": cpu_kernels.pack_gemm_weight's panels
    data: torch.Tensor
    out_features: int
    upcast: bool  # a float32 form of a bfloat16 weight: bfloat16 inputs are multiplied in float32
    # inputs of MANY_ROWS rows or more: "aten" (F.linear on the weight itself) or "onednn" / "panel" / "mkl"
    # (many_data, in that layout: mkl_gemm.pack_weight's for "mkl"); None: the same path as fewer rows
    many: str | None = None
    many_data: torch.Tensor | None = None

    @property
    def reads_weight(self) -> bool:
        """Does `linear` still read the weight itself (F.linear for many rows)? Else the packed layouts are all it
        reads, and the model need not keep the loaded weight."""
        return self.many == "aten"


@dataclass(frozen=True)
class LinearPlan:
    """What `calibrate` chose on this CPU: the model runner holds it and packs its weights by it."""

    few_rows: str  # "onednn" | "panel": below MANY_ROWS rows
    many_rows: str | None  # inputs of MANY_ROWS rows or more: "aten" | "onednn" | "panel" | "mkl"; None: as few_rows
    bf16_gemm: bool  # oneDNN multiplies bfloat16 natively here (else bf16 weights get a float32 form)
    one_forward_below: int = 0  # steps of fewer rows run as one forward on all threads (see splits_columns)
    gemm_blocking: int | None = None  # the float32 panel GEMM's (0 / 1: cpu_kernels.gemm_blockings); None: not measured

    def pack(self, weight: torch.Tensor, one_form: bool = False) -> PackedWeight | None:
        """weight [N, K] packed for this plan (made once at load); None where F.linear is the way (CUDA,
        other dtypes, no oneDNN). one_form: the few-rows path's layout only, for any number of rows, where the
        weight itself stays in memory anyway and a second layout would be one more copy (a tied lm_head is the
        embedding: 113 MB for SmolLM2-135M in float32, 1 GB for Llama 3.2 1B)."""
        if not _packable(weight):
            return None
        upcast = weight.dtype == torch.bfloat16 and not self.bf16_gemm
        return _pack(weight, self.few_rows, upcast, None if upcast or one_form else self._many())

    def _many(self) -> str | None:
        return None if self.many_rows == self.few_rows else self.many_rows

    def describe(self, dtype: torch.dtype) -> str:
        """The path in words, e.g. "kvfleet's panel GEMM below 256 rows, oneDNN packed from 256"."""
        if dtype == torch.bfloat16 and not self.bf16_gemm:
            return f"a float32 copy of each bf16 weight ({PATH_NAMES[self.few_rows]}): no bf16 GEMM here"
        def name(kind: str) -> str:
            if kind == "panel" and dtype == torch.bfloat16 and cpu_kernels.amx():
                return f"{PATH_NAMES[kind]} on AMX tiles"
            if kind == "panel" and dtype == torch.float32 and self.gemm_blocking is not None:
                return f"{PATH_NAMES[kind]} ({cpu_kernels.gemm_blockings()[self.gemm_blocking]})"
            return PATH_NAMES[kind]

        if self._many():
            text = f"{name(self.few_rows)} below {MANY_ROWS} rows, {name(self.many_rows)} from {MANY_ROWS}"
        else:
            text = f"{name(self.few_rows)} for any number of rows"
        return f"{text}, bf16 x bf16 natively" if dtype == torch.bfloat16 else text

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


def _layout(w: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "panel":
        return cpu_kernels.pack_gemm_weight(w)
    if kind == "mkl":
        return mkl_gemm.pack_weight(w, CALIBRATION_ROWS)
    return torch.ops.mkldnn._reorder_linear_weight(w)


def _pack(weight: torch.Tensor, kind: str, upcast: bool, many: str | None = None) -> PackedWeight:
    """weight in the layout of `kind` (and of `many` where that is another packed path); upcast: a float32
    form of a bfloat16 weight."""
    w = weight.detach().float() if upcast else weight.detach()
    many_data = _layout(w, many) if many in ("onednn", "panel", "mkl") else None
    return PackedWeight(kind, _layout(w, kind), w.shape[0], upcast, many, many_data)


def _run(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, many: bool = False,
         float_out: bool = False) -> torch.Tensor:
    """x through the packed weight's few-rows path, or its many-rows one (a packed layout, not "aten")."""
    kind, data = (packed.many, packed.many_data) if many else (packed.kind, packed.data)
    xx = x.float() if packed.upcast else x
    if kind == "panel":
        out = cpu_kernels.gemm(xx, data, packed.out_features, bias, float_out=float_out and not packed.upcast)
    elif kind == "mkl":
        out = mkl_gemm.gemm(xx, data, packed.out_features, bias)
    else:
        b = bias.float() if packed.upcast and bias is not None else bias
        out = torch.ops.mkldnn._linear_pointwise(xx, data, b, "none", [], "")
    if packed.upcast:
        out = out.to(x.dtype)
    return out.float() if float_out else out


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


def _streamed_copies(packed: PackedWeight, weight: torch.Tensor) -> list[PackedWeight]:
    """packed and more copies of weight in its layout: STREAMED_BYTES in all (at most 16), more than a
    last-level cache holds, so that a pass over them reads the weights from memory as a decode step does."""
    num_copies = min(16, -(-STREAMED_BYTES // packed.data.nbytes))
    return [packed] + [_pack(weight, packed.kind, packed.upcast) for _ in range(num_copies - 1)]


def _many_rows_cases(weights: Sequence[torch.Tensor], few: Sequence[str]) -> dict[str, Callable[[], object]]:
    """path -> one pass of CALIBRATION_ROWS rows through each of `weights` in turn, each in the path's layout:
    F.linear, the few-rows paths and (float32) MKL packed. In turn, as a forward runs them: F.linear's cost
    depends on what ran before it. The Xeon with AMX, one thread, 512 rows: MKL packed and F.linear level on
    any one shape repeated, MKL packed 8-17% ahead over a layer's four shapes in turn (measured; why, inside
    MKL's sgemm, is not known here)."""
    xs = [torch.randn(CALIBRATION_ROWS, w.shape[1]).to(w.dtype) for w in weights]
    kinds = [*few, *(["mkl"] * (weights[0].dtype == torch.float32 and mkl_gemm.available()))]
    packs = {kind: [_pack(w, kind, False) for w in weights] for kind in kinds}
    return {"aten": lambda: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
            **{kind: (lambda ps=ps: [_run(x, p, None) for x, p in zip(xs, ps, strict=True)])
               for kind, ps in packs.items()}}


def _one_call_wins(copies: list[PackedWeight], weight: torch.Tensor, threads: int) -> bool:
    """Is one call of threads * DECODE_ROWS rows on `threads` threads faster than `threads` concurrent
    single-threaded calls of DECODE_ROWS rows each? Over copies of the weight that no cache holds
    (`_streamed_copies`), as a forward streams its layers' weights. The caller's thread runs on `threads`
    threads."""
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


def calibrate(weight: torch.Tensor, layer: Sequence[torch.Tensor] = ()) -> LinearPlan | None:
    """Measure the paths on `weight` (a decoder layer's gate|up, [N, K]) and, for many rows, on `layer` (the
    weights of its layer in the order a forward multiplies them; MANY_COPIES copies of weight where not given):
    the plan to pack this model's weights by. None where nothing is packed (not a CPU float32 / bfloat16
    weight)."""
    if not _packable(weight):
        return None
    bf16_gemm = weight.dtype == torch.bfloat16 and _has_bf16_gemm(weight)
    upcast = weight.dtype == torch.bfloat16 and not bf16_gemm
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            few = {"onednn": _pack(weight, "onednn", upcast)}
            if cpu_kernels.gemm_available(torch.float32 if upcast else weight.dtype):
                few["panel"] = _pack(weight, "panel", upcast)
            choice, streamed, blocking = "onednn", {}, None
            if len(few) > 1:  # decode-sized inputs, over copies of the weight read from memory
                x = torch.randn(DECODE_ROWS, weight.shape[1]).to(weight.dtype)
                streamed = {name: _streamed_copies(p, weight) for name, p in few.items()}
                cases = {name: (lambda c=c: [_run(x, p, None) for p in c]) for name, c in streamed.items()}
                if weight.dtype == torch.float32 or upcast:  # the float32 panel GEMM under each of its blockings
                    panel = cases.pop("panel")
                    cases |= {f"panel/{b}": (lambda b=b: (cpu_kernels.gemm_blocking(b), panel()))
                              for b in (0, 1)}
                best = _fastest(cases)
                log.debug("decode-sized inputs, weights streamed: %s", best)
                choice = min(best, key=best.__getitem__)
                if "/" in choice:
                    choice, blocking = "panel", int(choice.split("/")[1])
                    cpu_kernels.gemm_blocking(blocking)  # process-wide, for every float32 panel GEMM from here
            many = None
            if not upcast:  # prefill-sized inputs: every path, through the layer's weights in turn
                weights = list(layer) or [weight] + [weight.clone() for _ in range(MANY_COPIES - 1)]
                best = _fastest(_many_rows_cases(weights, list(few)))
                log.debug("prefill-sized inputs (%d rows, %d weights in turn): %s", CALIBRATION_ROWS, len(weights),
                          best)
                many = min(best, key=best.__getitem__)
    finally:
        torch.set_num_threads(threads)
    # decode-sized steps: below MANY_ROWS, where the many-rows path may take over; over the chosen path's copies
    # timed above, if any
    one_below = 0
    if threads > 1 and _one_call_wins(streamed.get(choice) or _streamed_copies(few[choice], weight), weight, threads):
        one_below = MANY_ROWS
    return LinearPlan(choice, None if many == choice else many, bf16_gemm, one_below, blocking)


def linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor | None,  # [N, K]; None where packed does not read it (PackedWeight.reads_weight)
    bias: torch.Tensor | None = None,  # [N]
    packed: PackedWeight | None = None,  # LinearPlan.pack(weight)
    float_out: bool = False,  # float32 out: the result in x's dtype, widened (the logits)
) -> torch.Tensor:
    """x @ weight.T + bias -> [T, N], by the path the plan chose for this many rows."""
    many = packed is not None and packed.many is not None and x.shape[0] >= MANY_ROWS
    if packed is None or (many and packed.many == "aten"):
        out = F.linear(x, weight, bias)
        return out.float() if float_out else out
    return _run(x, packed, bias, many, float_out)
