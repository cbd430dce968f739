"""The native CPU kernels built for older CPUs' -march and run here (KVFLEET_CPU_MARCH), through the same kernel
tests as the native build, each in a child process (the library is loaded once per process): AVX-512 without
AVX512_BF16 (Skylake-SP, Ice Lake: bfloat16 through the float32 prefill kernel and the portable bf16 conversions),
AVX2 + FMA (Zen 3: the AVX2 attention kernels and panel GEMM), and none of them (the portable loops). Each runs
where this CPU has what it needs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.executor.ops.cpu import kernels

pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]
SUITES = ["tests/kernels/test_cpu_kernels.py", "tests/kernels/test_decode_stack.py", "tests/unit/test_cpu_linear.py"]


@pytest.mark.parametrize(("march", "isa"), [("skylake-avx512", "avx512"), ("x86-64-v3", "avx2"), ("x86-64", "scalar")])
def test_the_kernel_tests_pass_with_an_older_cpus_build(march, isa):
    try:
        kernels.check_march(march)
    except (ValueError, RuntimeError) as e:
        pytest.skip(f"this machine cannot build or run -march={march}: {e}")
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
