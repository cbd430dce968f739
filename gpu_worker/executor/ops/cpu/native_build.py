"""Native code compiled for this CPU: kvfleet's kernels (csrc/: cpu_kernels.cpp and its parts, one translation
unit) and the benchmark's peak-rate probe. Each is built once with the system's g++ into
~/.cache/kvfleet/<name>/<hash of source, flags and CPU>/ (a home shared between machines keeps one per CPU).
KVFLEET_CPU_MARCH names an older CPU's -march to build (and run its code paths here): check_march refuses one
whose extensions this CPU lacks, before anything is built."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.settings import foreign_var

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "cpu_kernels.cpp"  # the extern "C" functions; its parts (csrc/*.h) are included in order
# -ffp-contract=off: a * b + c stays two roundings, as in torch's elementwise ops (explicit FMAs stay FMAs);
# -march: Settings.cpu_march (KVFLEET_CPU_MARCH), "native" unless set
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17"]
# GCC's macro for each x86 extension an -march can enable, and its name among /proc/cpuinfo's flags: code built
# for an -march may use any of them anywhere (the compiler vectorizes on its own)
EXTENSIONS = {
    "__SSE4_2__": "sse4_2", "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
    "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm", "__MOVBE__": "movbe",
    "__ADX__": "adx", "__SHA__": "sha_ni", "__GFNI__": "gfni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
    "__AVXVNNI__": "avx_vnni", "__AVX512F__": "avx512f", "__AVX512DQ__": "avx512dq", "__AVX512CD__": "avx512cd",
    "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl", "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16", "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8",
}

def march_flags(march: str) -> list[str]:
    """The x86 extensions (as /proc/cpuinfo names them) that code compiled with -march=<march> may use; "native"
    resolves to this CPU's. ValueError naming the setting where the compiler knows no such -march."""
    cxx = compiler()
    proc = subprocess.run([cxx, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise ValueError(f"KVFLEET_CPU_MARCH={march!r}: {cxx} rejects -march={march}: "
                         f"{proc.stderr.strip()[-500:]}")
    defined = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
    return [flag for macro, flag in EXTENSIONS.items() if macro in defined]


def _cpuinfo_lines(*keys: str) -> list[str] | None:
    """The first /proc/cpuinfo line starting with each key ("" where none); None where there is no such file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return [next((ln for ln in lines if ln.startswith(k)), "") for k in keys]


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags, from /proc/cpuinfo (empty where there is none)."""
    found = _cpuinfo_lines("flags")
    return set(found[0].partition(":")[2].split()) if found else set()


def check_march(march: str) -> None:
    """ValueError where -march=<march> enables an extension this CPU lacks: code built for it would stop the
    process with SIGILL."""
    have = cpu_flags()
    missing = [f for f in march_flags(march) if f not in have] if have else []
    if missing:
        raise ValueError(f"KVFLEET_CPU_MARCH={march!r} builds the CPU kernels with {', '.join(missing)}, which this "
                         "CPU lacks (they would stop the process with SIGILL): unset it for -march=native, or name "
                         "an -march of an older CPU (x86-64-v3: AVX2 + FMA; x86-64: none)")


def compiler() -> str:
    """The C++ compiler: $CXX, else g++, else c++; RuntimeError where there is none."""
    found = shutil.which(foreign_var("CXX", "g++")) or shutil.which("c++")
    if found is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    return found


def _cpu_identity() -> str:
    """The CPU's model and instruction-set flags: -march=native code built on one CPU may not run on another
    (a home directory shared between machines)."""
    found = _cpuinfo_lines("model name", "flags")
    if found is None:
        import platform

        return platform.processor() or platform.machine()
    return "\n".join(found)


def source() -> str:
    """cpu_kernels.cpp with its parts (its `#include "x.h"` lines, files in csrc/) spliced in: one translation
    unit, the text that is hashed and compiled; #line keeps the compiler's messages at each part's own lines."""
    lines = []
    for number, line in enumerate(SOURCE.read_text().split("\n"), 1):
        part = re.fullmatch(r'#include "([\w.]+)"', line)
        if part is None:
            lines.append(line)
            continue
        text = (CSRC / part[1]).read_text().rstrip("\n")
        lines += [f'#line 1 "{part[1]}"', text, f'#line {number + 1} "{SOURCE.name}"']
    return "\n".join(lines)


def build_library(source: str, flags: list[str], name: str) -> Path:
    """source (C++) compiled once with the system's g++ and flags into ~/.cache/kvfleet/<name>/<hash of source,
    flags and CPU>/lib<name>.so, or the library built before; RuntimeError without a compiler or on an error."""
    key = hashlib.sha256((source + " ".join(flags) + _cpu_identity()).encode()).hexdigest()[:16]
    out = Path.home() / ".cache" / "kvfleet" / name / key / f"lib{name}.so"
    if out.is_file():
        return out
    cxx = compiler()
    log.info("compiling %s into %s (once)", name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / f"{name}.cpp", Path(tmp) / "lib.so"
        src.write_text(source)
        proc = subprocess.run([cxx, *flags, str(src), "-o", str(lib)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-2000:]}")
        os.replace(lib, out)  # atomic: a concurrent build just puts the same library in place
    return out
