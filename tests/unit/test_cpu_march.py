"""KVFLEET_CPU_MARCH (gpu_worker/executor/ops/cpu/native_build.py): the extensions an -march enables, read from the
compiler, and the refusal of one this CPU cannot run, before anything is built."""

import shutil

import pytest

from gpu_worker.executor.ops.cpu import native_build

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="needs a C++ compiler, as the kernels do")]

ZEN3 = {"sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "adx", "sha_ni", "vaes",
        "vpclmulqdq"}


def test_the_extensions_of_an_march_come_from_the_compiler():
    assert not {"avx", "avx2", "avx512f"} & set(native_build.march_flags("x86-64"))
    v3 = set(native_build.march_flags("x86-64-v3"))
    assert {"avx", "avx2", "fma", "f16c", "bmi2"} <= v3 and not any(f.startswith("avx512") for f in v3)
    skx = set(native_build.march_flags("skylake-avx512"))
    assert {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"} <= skx
    assert "avx512_bf16" not in skx and "amx_tile" not in skx
    assert {"avx512_bf16", "amx_tile", "amx_bf16"} <= set(native_build.march_flags("sapphirerapids"))


def test_native_is_what_this_cpu_has():
    have = native_build.cpu_flags()
    if not have:
        pytest.skip("no /proc/cpuinfo flags here")
    assert set(native_build.march_flags("native")) <= have


def test_an_march_this_cpu_cannot_run_is_refused_with_what_it_lacks(monkeypatch):
    monkeypatch.setattr(native_build, "cpu_flags", lambda: ZEN3)
    native_build.check_march("x86-64-v3")  # a Zen 3 runs AVX2 + FMA code
    with pytest.raises(ValueError) as e:
        native_build.check_march("skylake-avx512")
    message = str(e.value)
    assert "KVFLEET_CPU_MARCH='skylake-avx512'" in message and "SIGILL" in message
    assert "avx512f" in message and "avx512bw" in message and "avx2" not in message.split("which")[0]


def test_an_unknown_march_names_the_setting():
    with pytest.raises(ValueError, match=r"KVFLEET_CPU_MARCH='no-such-cpu'.*-march=no-such-cpu"):
        native_build.march_flags("no-such-cpu")
