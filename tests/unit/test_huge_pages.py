"""Importing gpu_worker turns on torch's transparent-huge-page allocation (before torch allocates anything);
THP_MEM_ALLOC_ENABLE=0 keeps it off. Each case runs in a fresh interpreter: torch reads the variable once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

CHILD = """
import os
import gpu_worker  # noqa: F401 - sets THP_MEM_ALLOC_ENABLE unless the caller did
import torch
x = torch.empty(64 * 2**20 // 4)  # 64 MiB
x.fill_(1.0)
huge = 0
with open("/proc/self/smaps_rollup") as f:
    for line in f:
        if line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
print(os.environ["THP_MEM_ALLOC_ENABLE"], huge)
"""


def _child(env_value: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split()
    return out[0], int(out[1])


def test_gpu_worker_sets_the_variable_and_a_user_value_wins():
    assert _child(None)[0] == "1"
    value, huge_kib = _child("0")
    assert value == "0"
    if THP_MODE.is_file() and "[madvise]" in THP_MODE.read_text():  # under "always" the kernel does it anyway
        assert huge_kib == 0


@pytest.mark.skipif(not THP_MODE.is_file() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off on this host")
def test_large_tensors_land_on_huge_pages():
    _, huge_kib = _child(None)
    assert huge_kib >= 32 * 1024, f"only {huge_kib} KiB of a 64 MiB tensor on huge pages"
