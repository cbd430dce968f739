"""services.bench.matmul_probe at a tiny shape: every linear path torch offers here is timed or, when torch
refuses it on this CPU (oneDNN's packed bfloat16 GEMM on a CPU without AVX-512), reported as unavailable
instead of failing the benchmark."""

from __future__ import annotations

import pytest

from services.bench import matmul_probe
from services.bench.metrics import ModelShape

pytestmark = pytest.mark.unit

TINY = ModelShape(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=256)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_path_is_timed_or_reported_unavailable(dtype):
    import torch

    from gpu_worker.executor.ops.cpu import kernels as cpu_kernels

    paths = set(matmul_probe._linear_paths(getattr(torch, dtype)))
    res = matmul_probe.probe_matmul(TINY, dtype, tokens=(8, 16), rounds=1, min_s=0.001)
    timed = {k.split("@")[0] for k in res.layer_flops}
    assert timed | set(res.unavailable) == paths and not timed & set(res.unavailable)
    assert "aten" in timed and res.best_flops > 0 and res.best_path in timed
    assert set(res.lm_head_flops) == set(res.layer_flops)
    # decode's rows over every layer's own weights, on the best path and on kvfleet's panel GEMM where built
    panel = [f"{matmul_probe.PANEL}@64"] if cpu_kernels.gemm_available(getattr(torch, dtype)) else []
    assert list(res.streamed_flops) == [f"{res.best_path}@64", *panel]
    assert all(v > 0 for v in res.streamed_flops.values())
    assert matmul_probe.probe_matmul(TINY, dtype, tokens=(8,), rounds=1, min_s=0.001,
                                     streamed_tokens=None, peak=False).streamed_flops == {}
    # the cores' peak, where the CPU has the dtype's multiply-adds: at least what a matmul reached (a matmul
    # cannot beat the instructions it is made of; the 2x margin is for the clock moving between the two)
    has = {"float32": cpu_kernels.isa() not in ("none", "scalar"), "bfloat16": "avx512_bf16" in cpu_kernels.isa()}
    if has[dtype]:
        assert res.peak_flops is not None and res.peak_flops * 2 > res.best_flops
        # bfloat16's from AMX tiles where the CPU has them (oneDNN's bf16 GEMM runs on them there: vdpbf16ps's rate
        # would be below what the matmul reaches)
        amx = dtype == "bfloat16" and cpu_kernels.amx()
        assert res.peak_instruction == {"float32": "FMA", "bfloat16": "AMX tdpbf16ps" if amx else "vdpbf16ps"}[dtype]
    else:
        assert res.peak_flops is None and res.peak_instruction is None


def test_a_path_torch_refuses_is_skipped_with_its_reason(monkeypatch):
    real = matmul_probe._linear_paths

    def with_a_refused_path(dtype):
        def refused(_w, _m):
            raise RuntimeError("needs the cpu support avx9000\nmore detail")
        return {**real(dtype), "refused": refused}

    monkeypatch.setattr(matmul_probe, "_linear_paths", with_a_refused_path)
    res = matmul_probe.probe_matmul(TINY, "float32", tokens=(8,), rounds=1, min_s=0.001)
    assert res.unavailable == {"refused": "needs the cpu support avx9000"}
    assert not any(k.startswith("refused@") for k in res.layer_flops)
