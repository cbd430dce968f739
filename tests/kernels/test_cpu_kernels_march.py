"""The native CPU kernels built for older CPUs' -march and run here (KVFLEET_CPU_MARCH), through the same kernel
tests as the native build, each in a child process (the library is loaded once per process): AVX512_BF16 without
AMX (Cooper Lake; Zen 4 and 5 have the same: the vdpbf16ps kernels as the only bf16 path), AVX-512 without
AVX512_BF16 (Skylake-SP, Ice Lake: bfloat16 through the float32 prefill kernel and the portable bf16 conversions),
AVX2 + FMA (Zen 3: the AVX2 attention kernels and panel GEMM), and none of them (the portable loops). Each runs
where this CPU has what it needs."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpu_worker.executor.ops.cpu import kernels, native_build

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]
SUITES = ["tests/kernels/test_cpu_kernels.py", "tests/kernels/test_decode_stack.py", "tests/unit/test_cpu_linear.py"]


# Zen 4 / 5 and Zen 3's builds in every run, but not the one whose kernel paths the native build here already took
# through the same tests (Cooper Lake's on a Zen 4 or 5, x86-64-v3 on a Zen 3: ~24 s of the default run, which had
# reached 16.4 minutes on a Zen 4); the CPUs none of this project's machines is (AVX-512 without AVX512_BF16, no
# AVX2) in the slow suite, which CI runs too (~20 s of the default run)
@pytest.mark.parametrize(("march", "isa"), [("cooperlake", "avx512+avx512_bf16"),
                                         pytest.param("skylake-avx512", "avx512", marks=pytest.mark.slow),
                                         ("x86-64-v3", "avx2"),
                                         pytest.param("x86-64", "scalar", marks=pytest.mark.slow)])
def test_the_kernel_tests_pass_with_an_older_cpus_build(march, isa):
    try:
        native_build.check_march(march)
    except (ValueError, RuntimeError) as e:
        pytest.skip(f"this machine cannot build or run -march={march}: {e}")
    if kernels.isa() == isa and not kernels.amx():  # (a CPU with AMX takes other bf16 paths than Cooper Lake's)
        pytest.skip(f"the native build here takes the same kernel paths ({isa}), and the kernel tests ran on it")
    env = {**os.environ, "KVFLEET_CPU_MARCH": march}
    probe = subprocess.run([sys.executable, "-c", "from gpu_worker.executor.ops.cpu import kernels; print(kernels.describe())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == f"{isa} (-march={march})"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITES], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail


def test_a_worker_refuses_an_march_it_cannot_build_at_start():
    """Before anything is compiled: the model runner's first use of the kernels raises with the setting named."""
    code = "from gpu_worker.executor.ops.cpu import kernels; kernels.load()"
    env = {**os.environ, "KVFLEET_CPU_MARCH": "no-such-cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "ValueError: KVFLEET_CPU_MARCH='no-such-cpu'" in proc.stderr and "-march=no-such-cpu" in proc.stderr


@pytest.mark.parametrize("library", ["cpu_kernels", "peak_rate"])
def test_the_amx_code_compiles_on_any_cpu(library, tmp_path):
    """The AMX code (the bf16 panel GEMM and prefill attention on tiles; the benchmark's tdpbf16ps peak) is built
    only where -march=native has AMX. Compiled here for Sapphire Rapids (not loaded: this CPU may lack AMX), so a
    CPU without AMX still checks it."""
    from services.bench import peak_rate

    try:
        compiler = native_build.compiler()
        native_build.march_flags("sapphirerapids")
    except (ValueError, RuntimeError) as e:
        pytest.skip(f"no compiler that knows -march=sapphirerapids: {e}")
    source, flags = ((native_build.source(), native_build.FLAGS) if library == "cpu_kernels"
                     else (peak_rate.SOURCE, peak_rate.FLAGS))
    flags = [f for f in flags if f not in ("-shared", "-march=native")] + ["-march=sapphirerapids"]
    src = tmp_path / f"{library}.cpp"
    src.write_text(source)
    macros = subprocess.run([compiler, *flags, "-dM", "-E", str(src)], capture_output=True, text=True, timeout=120)
    assert macros.returncode == 0, macros.stderr[-2000:]
    if library == "cpu_kernels":  # the AMX kernels are in this build, not left out by their #if
        assert "#define KVF_AMX 1" in macros.stdout and "#define KVF_GEMM_BF16_AMX 1" in macros.stdout
    else:
        assert "#define __AMX_BF16__ 1" in macros.stdout
    proc = subprocess.run([compiler, *flags, "-c", str(src), "-o", str(tmp_path / "out.o")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_part_of_the_kernels_is_compiled_once_and_errors_name_its_file(tmp_path):
    """cpu_kernels.cpp includes its parts (csrc/*.h) in order; native_build.source() splices each in once, and the
    compiler's messages name the part's file and line (#line), not a line of the spliced text."""
    parts = sorted(p.name for p in native_build.CSRC.glob("*.h"))
    text = native_build.source()
    assert '#include "' not in text
    assert sorted(line.split('"')[1] for line in text.splitlines() if line.startswith("#line 1 ")) == parts
    broken = text.replace("int g_gemm_blocking = 0;", "int g_gemm_blocking = 0 +;")
    line = next(i for i, s in enumerate((native_build.CSRC / "gemm_f32.h").read_text().splitlines(), 1)
                if s.startswith("int g_gemm_blocking"))
    src = tmp_path / "cpu_kernels.cpp"
    src.write_text(broken)
    flags = [f for f in native_build.FLAGS if f != "-shared"]
    proc = subprocess.run([native_build.compiler(), *flags, "-fsyntax-only", str(src)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and f"gemm_f32.h:{line}:" in proc.stderr, proc.stderr[-2000:]
    # and every part ships in the package (`pip install .`: the worker image), which builds them on first use
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["gpu_worker.executor.ops.cpu"]
    package = native_build.CSRC.parent
    assert all(any(p.relative_to(package).match(g) for g in shipped) for p in native_build.CSRC.iterdir()), shipped
