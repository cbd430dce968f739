"""gpu_worker.executor.ops.cpu.linear: every plan calibrate may choose gives x @ w.T + b; the bfloat16 paths."""

import pytest
import torch

from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu import linear as cpu_linear
from gpu_worker.executor.ops.cpu import mkl_gemm

pytestmark = pytest.mark.unit

PLANS = [cpu_linear.LinearPlan("onednn", None, False), cpu_linear.LinearPlan("onednn", "aten", False)]
if cpu_kernels.gemm_available():
    PLANS += [cpu_linear.LinearPlan(few, many, False)
              for few, many in [("panel", None), ("panel", "aten"), ("panel", "onednn"), ("onednn", "panel")]]
if mkl_gemm.available():
    PLANS += [cpu_linear.LinearPlan(few, "mkl", False)
              for few in ("onednn", "panel")[:1 + cpu_kernels.gemm_available()]]


@pytest.fixture
def plan(request):
    return request.param


@pytest.mark.parametrize("plan", PLANS, indirect=True, ids=lambda p: f"{p.few_rows}-{p.many_rows}")
@pytest.mark.parametrize("rows", [3, 300])  # below and above the switch to the many-rows path
def test_every_plan_computes_the_same_linear(plan, rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(48, 40, generator=g), torch.randn(48, generator=g), torch.randn(rows, 40, generator=g)
    packed = plan.pack(w)
    assert packed.kind == plan.few_rows and not packed.upcast and packed.many == plan.many_rows
    assert (packed.many_data is not None) == (plan.many_rows in ("onednn", "panel", "mkl"))
    taken = []
    real_run = cpu_linear._run
    monkeypatch.setattr(cpu_linear, "_run", lambda x, p, b, many=False, float_out=False: taken.append(
        p.many if many else p.kind) or real_run(x, p, b, many, float_out))
    monkeypatch.setattr(cpu_linear.F, "linear", lambda *a, real=cpu_linear.F.linear: taken.append("aten") or real(*a))
    torch.testing.assert_close(cpu_linear.linear(x, w, b, packed), x @ w.T + b, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_linear.linear(x, w, None, packed), x @ w.T, atol=1e-4, rtol=1e-5)
    want = plan.many_rows if rows >= cpu_linear.MANY_ROWS and plan.many_rows else plan.few_rows
    assert taken == [want, want]


@pytest.mark.parametrize("kind", ["onednn", "panel"])
def test_bfloat16_through_a_float32_weight_equals_float32_math(kind):
    """The path of CPUs without a bf16 GEMM: bf16 activations times a float32 copy of the bf16 weight."""
    if kind == "panel" and not cpu_kernels.gemm_available():
        pytest.skip("the panel GEMM needs AVX2 + FMA")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    packed = cpu_linear._pack(w, kind, upcast=True)
    assert packed.upcast and packed.data.dtype == torch.float32
    out = cpu_linear.linear(x, w, b, packed)
    assert out.dtype == torch.bfloat16
    want = (x.float() @ w.float().T + b.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, want, atol=0, rtol=2**-7)


def test_calibrate_returns_a_plan_that_packs_by_it():
    w = torch.randn(96, 64)
    plan = cpu_linear.calibrate(w)
    assert plan.few_rows in ("onednn", "panel") and plan.many_rows in (None, "aten", "onednn", "panel", "mkl")
    assert plan.many_rows != plan.few_rows  # None where the two are the same path
    packed = plan.pack(w)
    assert packed.kind == plan.few_rows and packed.many == plan.many_rows
    assert plan.describe(torch.float32).startswith(cpu_linear.PATH_NAMES[plan.few_rows])


def test_describe_names_both_paths():
    assert (cpu_linear.LinearPlan("panel", "onednn", False).describe(torch.float32)
            == f"kvfleet's panel GEMM below {cpu_linear.MANY_ROWS} rows, oneDNN packed from {cpu_linear.MANY_ROWS}")
    assert cpu_linear.LinearPlan("onednn", None, False).describe(torch.float32) == "oneDNN packed for any number of rows"


def test_bfloat16_weights_never_take_the_float32_switch():
    for many in ("aten", "panel"):
        packed = cpu_linear.LinearPlan("onednn", many, bf16_gemm=False).pack(torch.randn(16, 8).to(torch.bfloat16))
        assert packed.upcast and packed.many is None and packed.many_data is None


def test_nothing_packed_off_cpu_float_weights():
    assert cpu_linear.calibrate(torch.randn(8, 8, dtype=torch.float16)) is None
    assert cpu_linear.LinearPlan("onednn", None, False).pack(torch.randn(8, 8, dtype=torch.float16)) is None


def test_one_forward_only_for_the_rows_calibrate_measured_it_for():
    plan = cpu_linear.LinearPlan("panel", "aten", False, one_forward_below=256)
    assert plan.splits_columns(64)
    assert not plan.splits_columns(256)
    assert not cpu_linear.LinearPlan("onednn", "aten", False).splits_columns(1)  # not measured: P forwards


@pytest.mark.parametrize("threads", [1, 2])
def test_calibrate_decides_one_forward_only_with_threads_to_split(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = cpu_linear.calibrate(torch.randn(256, 128))
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    if threads == 1:
        assert plan.one_forward_below == 0
    else:
        assert plan.one_forward_below in (0, cpu_linear.MANY_ROWS)


def test_the_one_call_measurement_runs_both_ways(monkeypatch):
    """_one_call_wins times P concurrent single-threaded calls against one call on P threads, over copies of
    the weight: whichever is faster wins, whatever the CPU."""
    w = torch.randn(64, 32)
    packed = cpu_linear._pack(w, "onednn", upcast=False)
    seen = []
    real_run = cpu_linear._run
    monkeypatch.setattr(cpu_linear, "_run", lambda x, p, b, many=False: seen.append(
        (x.shape[0], torch.get_num_threads())) or real_run(x, p, b, many))
    monkeypatch.setattr(cpu_linear, "STREAMED_BYTES", 4 * packed.data.nbytes)
    monkeypatch.setattr(cpu_linear, "_fastest", lambda cases, rounds=4: {
        name: (fn(), 1.0 if name == "one" else 2.0)[1] for name, fn in cases.items()})
    assert cpu_linear._one_call_wins(cpu_linear._streamed_copies(packed, w), w, threads=2)
    assert (2 * cpu_linear.DECODE_ROWS, torch.get_num_threads()) in seen  # the one call, on the caller's threads
    assert seen.count((cpu_linear.DECODE_ROWS, 1)) == 2 * 4  # two single-threaded calls per copy, 4 copies
    monkeypatch.setattr(cpu_linear, "_fastest", lambda cases, rounds=4: {
        name: 2.0 if name == "one" else 1.0 for name in cases})
    assert not cpu_linear._one_call_wins(cpu_linear._streamed_copies(packed, w), w, threads=2)


@pytest.mark.skipif(not cpu_kernels.gemm_available(), reason="the panel GEMM needs AVX2 + FMA")
@pytest.mark.parametrize("few,many", [("panel/0", "onednn"), ("panel/1", "onednn"), ("onednn", "aten"),
                                      ("panel/1", "panel"), ("panel/0", "mkl"), ("onednn", "mkl")])
def test_calibrate_takes_what_it_measured_fastest(monkeypatch, few, many):
    """Few rows are timed over streamed copies of the weight (a decode step reads each weight from memory), the
    float32 panel GEMM under each of its blockings; many rows on the weight itself, MKL's packed GEMM among
    them where torch has MKL; each choice is whichever candidate measured fastest, and the panel GEMM's blocking
    is set for the process."""
    if many == "mkl" and not mkl_gemm.available():
        pytest.skip("torch without MKL")
    calls = []

    def fastest(cases, rounds=4):
        calls.append(sorted(cases))
        winner = few if len(calls) == 1 else many
        return {name: 1.0 if name == winner else 2.0 for name in cases}

    monkeypatch.setattr(cpu_linear, "_fastest", fastest)
    monkeypatch.setattr(cpu_linear, "STREAMED_BYTES", 1 << 16)
    before, blocking = torch.get_num_threads(), cpu_kernels.gemm_blocking()
    cpu_kernels.gemm_blocking(1 - int(few[-1]) if "/" in few else 0)  # the other one, to see it change
    torch.set_num_threads(1)
    try:
        plan = cpu_linear.calibrate(torch.randn(64, 32))
        in_use = cpu_kernels.gemm_blocking()
    finally:
        torch.set_num_threads(before)
        cpu_kernels.gemm_blocking(blocking)
    assert calls == [["onednn", "panel/0", "panel/1"], ["aten", *(["mkl"] * mkl_gemm.available()), "onednn", "panel"]]
    kind = few.split("/")[0]
    assert plan.few_rows == kind and plan.many_rows == (None if many == kind else many)
    assert plan.gemm_blocking == (int(few[-1]) if kind == "panel" else None)
    if kind == "panel":
        assert in_use == plan.gemm_blocking
        named = cpu_kernels.gemm_blockings()[plan.gemm_blocking]
        assert f"kvfleet's panel GEMM ({named})" in plan.describe(torch.float32)


@pytest.mark.skipif(not cpu_kernels.gemm_available(torch.bfloat16), reason="the bf16 panel GEMM needs AVX512_BF16")
@pytest.mark.parametrize("few,many", [("panel", None), ("panel", "onednn"), ("onednn", "panel")])
@pytest.mark.parametrize("rows", [3, 300])
def test_native_bfloat16_plans_keep_bfloat16_weights(few, many, rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 40, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    x = torch.randn(rows, 40, generator=g).bfloat16()
    packed = cpu_linear.LinearPlan(few, many, bf16_gemm=True).pack(w)
    assert not packed.upcast and packed.kind == few and packed.many == many
    assert packed.data.dtype == torch.bfloat16 or few == "onednn"
    out = cpu_linear.linear(x, w, b, packed)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=2e-2, rtol=2**-7)
    wide = cpu_linear.linear(x, w, b, packed, float_out=True)  # the logits: rounded to bf16, then widened
    assert wide.dtype == torch.float32 and torch.equal(wide, out.float())


@pytest.mark.parametrize("packing", ["none", "aten", "upcast-onednn", "upcast-panel", "float32-panel"])
def test_float_out_is_the_result_widened_on_every_path(packing):
    """linear(..., float_out=True) == linear(...).float(), whichever path runs (the logits' form)."""
    if packing.endswith("panel") and not cpu_kernels.gemm_available():
        pytest.skip("the panel GEMM needs AVX2 + FMA")
    g = torch.Generator().manual_seed(3)
    dtype = torch.float32 if packing.startswith("float32") else torch.bfloat16
    w, x = torch.randn(50, 40, generator=g).to(dtype), torch.randn(300, 40, generator=g).to(dtype)
    if packing == "aten":
        w, x = w.float(), x.float()
    packed = {"none": lambda: None, "aten": lambda: cpu_linear.LinearPlan("onednn", "aten", False).pack(w),
              "upcast-onednn": lambda: cpu_linear._pack(w, "onednn", upcast=True),
              "upcast-panel": lambda: cpu_linear._pack(w, "panel", upcast=True),
              "float32-panel": lambda: cpu_linear._pack(w, "panel", upcast=False)}[packing]()
    out, wide = cpu_linear.linear(x, w, None, packed), cpu_linear.linear(x, w, None, packed, float_out=True)
    assert out.dtype == x.dtype and wide.dtype == torch.float32
    assert torch.equal(wide, out.float())


@pytest.mark.skipif(not (cpu_kernels.gemm_available(torch.bfloat16) and cpu_linear._has_bf16_gemm(torch.ones(1, 1))),
                    reason="needs both bf16 GEMMs (AVX512_BF16)")
def test_calibrate_measures_the_bf16_panel_gemm_too(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear, "_fastest", lambda cases, rounds=4: calls.append(sorted(cases)) or {
        name: 1.0 if name == "panel" else 2.0 for name in cases})
    monkeypatch.setattr(cpu_linear, "STREAMED_BYTES", 1 << 16)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = cpu_linear.calibrate(torch.randn(64, 32).bfloat16())
    finally:
        torch.set_num_threads(before)
    assert calls == [["onednn", "panel"], ["aten", "onednn", "panel"]]
    assert plan == cpu_linear.LinearPlan("panel", None, bf16_gemm=True)
    amx = cpu_kernels.amx()
    on = " on AMX tiles" if amx else ""
    assert plan.describe(torch.bfloat16) == f"kvfleet's panel GEMM{on} for any number of rows, bf16 x bf16 natively"
    if amx:  # the vdpbf16ps kernel, where the tiles are turned off: its plain name
        try:
            cpu_kernels.amx(False)
            assert plan.describe(torch.bfloat16).startswith("kvfleet's panel GEMM for any")
        finally:
            cpu_kernels.amx(True)


def test_a_linear_that_reads_only_its_packed_forms_needs_no_weight():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 40, generator=g), torch.randn(300, 40, generator=g)
    for many in (None, "onednn", *(["mkl"] * mkl_gemm.available())):
        packed = cpu_linear.LinearPlan("onednn", many, False).pack(w)
        assert not packed.reads_weight
        torch.testing.assert_close(cpu_linear.linear(x, None, None, packed), x @ w.T, atol=1e-4, rtol=1e-5)
    assert cpu_linear.LinearPlan("onednn", "aten", False).pack(w).reads_weight


def test_many_rows_are_timed_through_the_layers_weights_in_turn(monkeypatch):
    """Given its layer, calibrate times each many-rows path over the layer's weights in the forward's order (MKL's
    sgemm costs more when the shape changes from call to call than on one weight repeated), each result right."""
    layer = [torch.randn(48, 32), torch.randn(32, 32), torch.randn(64, 32), torch.randn(32, 64)]
    seen, real_linear = [], cpu_linear.F.linear
    monkeypatch.setattr(cpu_linear.F, "linear", lambda x, w, *a: seen.append(tuple(w.shape)) or real_linear(x, w, *a))
    timed = []

    def fastest(cases, rounds=4):
        names = sorted(cases)
        timed.append(names)
        if "aten" in cases:  # the many-rows round: run each path once
            seen.clear()
            cases["aten"]()
        return {name: 1.0 if name == names[-1] else 2.0 for name in cases}

    monkeypatch.setattr(cpu_linear, "_fastest", fastest)
    monkeypatch.setattr(cpu_linear, "STREAMED_BYTES", 1 << 16)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = cpu_linear.calibrate(layer[2], layer)
    finally:
        torch.set_num_threads(before)
    assert seen == [tuple(w.shape) for w in layer]
    many = timed[-1]
    assert many == sorted(["aten", "onednn", *(["panel"] * cpu_kernels.gemm_available()),
                           *(["mkl"] * mkl_gemm.available())])
    assert plan.many_rows == (None if many[-1] == plan.few_rows else many[-1])
    x = torch.randn(300, 32)
    torch.testing.assert_close(cpu_linear.linear(x, layer[0], None, plan.pack(layer[0])), x @ layer[0].T,
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("plan", PLANS, indirect=True, ids=lambda p: f"{p.few_rows}-{p.many_rows}")
def test_one_form_packs_only_the_few_rows_layout_for_every_row_count(plan):
    """A weight that stays in memory anyway (a tied lm_head) gets no second layout: many rows take the few-rows
    path too, and the results are right either way."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 40, generator=g), torch.randn(300, 40, generator=g)
    packed = plan.pack(w, one_form=True)
    assert packed.kind == plan.few_rows and packed.many is None and packed.many_data is None
    torch.testing.assert_close(cpu_linear.linear(x, w, None, packed), x @ w.T, atol=1e-4, rtol=1e-5)
