"""How fast torch multiplies matrices at the model's shapes on this machine: the ceiling for the engine.

For each way torch offers to run a linear layer on CPU (aten's F.linear: MKL for float32, oneDNN for
bfloat16; oneDNN with a weight packed ahead of time; MKL's packed GEMM for float32) and a few token counts,
time one decoder layer's matmuls (qkv, o, gate|up, down) back to back. Rounds interleave the candidates and
each keeps its fastest round, so a neighbour's burst on a shared machine costs the probe little.

One layer's weights fit in the last-level cache; a decode step's do not (every layer's, then the lm_head, each
read once a step). So the probe also times the best path at decode's row count over every layer's own weights
and the lm_head, one pass a call (`streamed_flops`): the bound of a decode step's linear layers, weights
streamed from memory as the engine streams them; and the same with kvfleet's panel GEMM, where it is built.
Last, the cores' multiply-add peak at that moment (services.bench.peak_rate): how near the matmuls come to the
instructions' own rate, on a clock that moves with the neighbours' load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.bench.metrics import ModelShape

PROBE_TOKENS = (64, 256, 1024)


@dataclass
class ProbeResult:
    dtype: str
    best_flops: float  # FLOP/s: the fastest (path, tokens) for a whole layer's matmuls
    best_path: str
    best_tokens: int
    layer_flops: dict[str, float] = field(default_factory=dict)  # "path@tokens" -> FLOP/s
    lm_head_flops: dict[str, float] = field(default_factory=dict)  # "path@tokens" -> FLOP/s
    unavailable: dict[str, str] = field(default_factory=dict)  # path -> why torch refused it on this CPU
    # "path@tokens" -> FLOP/s over all layers' own weights and the lm_head (a decode step's linear layers)
    streamed_flops: dict[str, float] = field(default_factory=dict)
    # the cores' multiply-add peak in this dtype right after (services.bench.peak_rate, torch's thread count);
    # None: not measured, or no such instructions here
    peak_flops: float | None = None
    peak_instruction: str | None = None  # what reached peak_flops: "FMA", "vdpbf16ps", "AMX tdpbf16ps"


def _linear_paths(dtype) -> dict[str, Callable]:
    """name -> make(weight [N, K], tokens) -> fn(x [tokens, K]) -> [tokens, N]."""
    import torch
    import torch.nn.functional as F

    def aten(w, m):
        return lambda x: F.linear(x, w)

    def onednn_packed(w, m):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def mkl_packed(w, m):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, m)

    paths = {"aten": aten}
    if torch.backends.mkldnn.is_available():
        paths["onednn-packed"] = onednn_packed
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        paths["mkl-packed"] = mkl_packed
    return paths


PANEL = "kvfleet-panel"


def _kvfleet_panel(dtype) -> Callable | None:
    """kvfleet's own panel GEMM (the engine's decode path where its calibration picks it), where it is built for
    dtype; None elsewhere. Not one of torch's paths: timed for a decode step's bound only, never the best matmul."""
    from gpu_worker.executor.ops.cpu import kernels as cpu_kernels

    if not cpu_kernels.gemm_available(dtype):
        return None

    def make(w, m):
        packed = cpu_kernels.pack_gemm_weight(w)
        return lambda x: cpu_kernels.gemm(x, packed, w.shape[0])
    return make


def _time(fn: Callable[[], object], min_s: float) -> float:
    """Seconds per call, averaged over a run of at least min_s."""
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def probe_matmul(shape: ModelShape, dtype_name: str, *, tokens: tuple[int, ...] = PROBE_TOKENS,
                 rounds: int = 5, min_s: float = 0.03, include_lm_head: bool = True,
                 streamed_tokens: int | None = 64, peak: bool = True) -> ProbeResult:
    import torch

    from services.bench.peak_rate import peak_flops

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    layer = [(k, n) for _, k, n in shape.linear_shapes()]
    weights = [torch.randn(n, k, generator=gen).mul_(0.02).to(dtype) for k, n in layer]  # [N, K] each
    lm_weight = torch.randn(shape.vocab_size, shape.hidden_size, generator=gen).mul_(0.02).to(dtype)
    layer_cases: dict[str, tuple[Callable, float]] = {}
    head_cases: dict[str, tuple[Callable, float]] = {}
    unavailable: dict[str, str] = {}
    for path, make in _linear_paths(dtype).items():
        try:  # some paths need instructions this CPU lacks (oneDNN's packed bf16 GEMM: AVX-512 or AVX-NE-CONVERT)
            with torch.inference_mode():
                make(weights[0], tokens[0])(torch.zeros(tokens[0], layer[0][0], dtype=dtype))
        except RuntimeError as e:
            unavailable[path] = str(e).splitlines()[0]
            continue
        for m in tokens:
            xs = [torch.randn(m, k, generator=gen).to(dtype) for k, _ in layer]  # [m, K] each
            fns = [make(w, m) for w in weights]

            def run_layer(fns=fns, xs=xs):
                for f, x in zip(fns, xs, strict=True):
                    f(x)

            layer_cases[f"{path}@{m}"] = (run_layer, 2 * m * sum(k * n for k, n in layer))
            if include_lm_head:
                head, hx = make(lm_weight, m), torch.randn(m, shape.hidden_size, generator=gen).to(dtype)
                head_cases[f"{path}@{m}"] = (lambda head=head, hx=hx: head(hx), 2 * m * lm_weight.numel())
    best_time: dict[str, float] = {}
    with torch.inference_mode():
        for fn, _ in [*layer_cases.values(), *head_cases.values()]:
            fn()  # warm up: first calls allocate and pick kernels
        for _ in range(rounds):
            for key, (fn, _) in layer_cases.items():
                best_time[key] = min(best_time.get(key, float("inf")), _time(fn, min_s))
            for key, (fn, _) in head_cases.items():
                k = f"head:{key}"
                best_time[k] = min(best_time.get(k, float("inf")), _time(fn, min_s / 2))
    layer_flops = {k: flops / best_time[k] for k, (_, flops) in layer_cases.items()}
    head_flops = {k: flops / best_time[f"head:{k}"] for k, (_, flops) in head_cases.items()}
    best_key = max(layer_flops, key=layer_flops.__getitem__)
    path, tokens_text = best_key.split("@")
    del layer_cases, head_cases, weights
    streamed = {}
    if streamed_tokens:
        makers = {path: _linear_paths(dtype)[path], PANEL: _kvfleet_panel(dtype)}
        for name, make in makers.items():
            if make is not None:
                streamed[f"{name}@{streamed_tokens}"] = _streamed(shape, dtype, make, streamed_tokens, lm_weight,
                                                                  rounds, 4 * min_s, gen)
    peak_rate = peak_flops(torch.get_num_threads()).get(dtype_name) if peak else None
    return ProbeResult(dtype=dtype_name, best_flops=layer_flops[best_key], best_path=path,
                       best_tokens=int(tokens_text), layer_flops=layer_flops, lm_head_flops=head_flops,
                       unavailable=unavailable, streamed_flops=streamed,
                       peak_flops=peak_rate and peak_rate.flops, peak_instruction=peak_rate and peak_rate.instruction)


def best_layer_now(shape: ModelShape, dtype_name: str) -> ProbeResult:
    """The probe's layer cases alone (no lm_head, no streamed weights, no peak): the best matmul at this moment, for
    a reading next to each round of `kvfleet bench throughput --rounds` on a clock that moves (float32 ~4 s,
    bfloat16 ~2 s on 2 Zen 5 cores)."""
    return probe_matmul(shape, dtype_name, include_lm_head=False, streamed_tokens=None, peak=False)


def _streamed(shape: ModelShape, dtype, make: Callable, m: int, lm_weight, rounds: int, min_s: float,
              gen) -> float:
    """FLOP/s of m rows through every layer's own matmuls, then the lm_head: weights read from memory."""
    import torch

    layer = [(k, n) for _, k, n in shape.linear_shapes()]
    fns, xs = [], []
    for _ in range(shape.num_layers):
        for k, n in layer:
            fns.append(make(torch.randn(n, k, generator=gen).mul_(0.02).to(dtype), m))
            xs.append(torch.randn(m, k, generator=gen).to(dtype))
    fns.append(make(lm_weight, m))
    xs.append(torch.randn(m, shape.hidden_size, generator=gen).to(dtype))
    flops = 2 * m * (shape.num_layers * sum(k * n for k, n in layer) + lm_weight.numel())

    def run_model():
        for f, x in zip(fns, xs, strict=True):
            f(x)

    with torch.inference_mode():
        run_model()
        best = min(_time(run_model, min_s) for _ in range(rounds))
    return flops / best
