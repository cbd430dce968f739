"""`kvfleet bench gateway` whole: a fleet of two gateway replicas (each held to a share of a core when this machine
lets a cgroup be made) and zero-cost simulated workers under `wrk`; the report adds up, every answer was a 200, the
quota held, and nothing is left behind (the fleet's processes, the cgroups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench.gateway_load import CGROUP_V1, CGROUP_V2

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SHARE = 0.3


def _groups() -> list[Path]:
    return [*CGROUP_V1.glob("kvfleet-bench-*"), *CGROUP_V2.glob("kvfleet-bench-*")]


def test_two_replicas_under_wrk_report_what_they_carried(tmp_path):
    quota = os.access(CGROUP_V1 if CGROUP_V1.is_dir() else CGROUP_V2, os.W_OK)
    # 16 connections per gateway: 32 requests in flight at most, fewer than the shared queue's 64, so that no
    # answer is the fleet's backpressure (429 fleet_overloaded), however fast the gateways are against the rest
    # of the fleet on this machine (a 2-core Zen 5 at 64 per gateway: the workers, Redis and wrk, sharing one
    # core, fell behind)
    cmd = [sys.executable, "-m", "services.cli", "bench", "gateway", "--gateways", "2", "--duration", "3",
           "--warmup", "1", "--connections", "16", "--json", *(["--cpu-share", str(SHARE)] if quota else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["cpu"]["model"] and report["gateways"] == 2 and report["cpu_share"] == (SHARE if quota else None)
    (r,) = report["rounds"]
    assert r["requests"] > 100 and r["non_2xx"] == 0 and r["timeouts"] == 0 and r["socket_errors"] == 0, r
    assert r["requests_per_s"] == pytest.approx(r["requests"] / r["wall_s"], rel=0.01)
    assert r["cpu_ms_per_request"] == pytest.approx(1000 * r["gateway_cpu_s"] / r["requests"], rel=0.01)
    if quota:  # two gateways, each held to SHARE of a core (the clock ticks give a little slack)
        assert r["gateway_cpu_share"] <= 2 * SHARE * 1.15, r
    assert _groups() == []
    leftover = subprocess.run(["pgrep", "-f", "services.cli (up|gateway|worker) .*--simulate zero"],
                              capture_output=True, text=True).stdout.split()
    assert leftover == [], leftover
