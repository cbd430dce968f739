"""This machine's CPU, as every benchmark reports it beside its figures: model name, family and model number,
logical cores, the SIMD flags the kernels choose paths by, and the load average when the run began (other work
on a shared machine skews what it measures)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
              "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """model, family, model_number, cores, simd (the SIMD_FLAGS present), load_average_1m, flags (all of them)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block says it all
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = fields.get("flags", "").split()
    return {"model": fields.get("model name", "unknown"), "family": fields.get("cpu family", "?"),
            "model_number": fields.get("model", "?"), "cores": os.cpu_count(),
            "simd": [f for f in SIMD_FLAGS if f in flags], "load_average_1m": round(os.getloadavg()[0], 2),
            "flags": flags}


def describe(info: dict[str, Any] | None = None) -> str:
    """'<model> (family F model M; <simd flags>)', for a line of a report or a profile's source."""
    info = info or cpu_info()
    return (f"{info['model']} (family {info['family']} model {info['model_number']}; "
            f"{' '.join(info['simd']) or 'no AVX'})")
