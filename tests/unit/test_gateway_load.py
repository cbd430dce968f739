"""`kvfleet bench gateway`'s parts that need no fleet: wrk's report read, the round's arithmetic, the table, and
the checks that refuse a run that could not measure anything (tests/e2e/test_bench_gateway.py runs it whole)."""

from __future__ import annotations

import argparse

import pytest

from services.bench import gateway_load
from services.bench.gateway_load import Round, WrkCounts, format_report, parse_wrk
from services.bench.serve_endpoints import ServerFailed

pytestmark = pytest.mark.unit

WRK_OK = """Running 15s test @ http://127.0.0.1:18600/v1/completions
  1 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   172.00ms   79.15ms 521.38ms   81.26%
    Req/Sec   393.99    148.88   720.00     74.13%
  5690 requests in 15.06s, 2.94MB read
Requests/sec:    377.75
Transfer/sec:    199.90KB
"""


def test_wrk_reports_are_read_with_their_errors():
    assert parse_wrk(WRK_OK) == WrkCounts(requests=5690, non_2xx=0, timeouts=0, socket_errors=0)
    with_errors = WRK_OK.replace("Requests/sec", "  Non-2xx or 3xx responses: 12\nRequests/sec")
    assert parse_wrk(with_errors) == WrkCounts(requests=5690, non_2xx=12, timeouts=0, socket_errors=0)
    # what wrk printed when a loaded machine answered slower than its timeout: no request completed, 16 gave up
    timed_out = WRK_OK.replace("5690 requests", "0 requests").replace(
        "Requests/sec", "  Socket errors: connect 1, read 2, write 3, timeout 16\nRequests/sec")
    assert parse_wrk(timed_out) == WrkCounts(requests=0, non_2xx=0, timeouts=16, socket_errors=6)
    with pytest.raises(ServerFailed, match="no result"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


def test_a_round_gives_cpu_per_request_and_the_rate_per_core():
    row = Round(requests=3000, non_2xx=0, wall_s=10.0, gateway_cpu_s=2.7).row()
    assert row["requests_per_s"] == 300.0 and row["gateway_cpu_share"] == 0.27 and row["cpu_us_per_token"] == 900
    assert Round(requests=3000, non_2xx=0, wall_s=10.0, gateway_cpu_s=2.7, tokens_per_request=64).row()[
        "cpu_us_per_token"] == pytest.approx(900 / 64, abs=0.1)
    assert row["cpu_ms_per_request"] == 0.9 and row["requests_per_s_per_core"] == 1111
    report = {"cpu": {"model": "AMD EPYC", "family": "25", "model_number": "1", "cores": 2, "simd": ["avx2"],
                      "load_average_1m": 0.5}, "gateways": 2, "workers": 2, "profile": "zero", "cpu_share": 0.15,
              "connections": 64, "duration_s": 10.0, "max_tokens": 1, "rounds": [row]}
    table = format_report(report)
    assert "AMD EPYC (family 25 model 1; avx2)" in table and "0.15 of a core" in table
    assert "| 1 | 300.0 | 0 | 0 / 0 | 0.27 | 0.900 ms | 1,111 | 900.0 us |" in table
    slow = Round(requests=10, non_2xx=0, wall_s=1.0, gateway_cpu_s=0.5, timeouts=7, socket_errors=2).row()
    assert "| 1 | 10.0 | 0 | 7 / 2 |" in format_report({**report, "rounds": [slow]})


def _args(**kw) -> argparse.Namespace:
    base = dict(gateways=1, workers=2, connections=64, rounds=1, max_tokens=1, duration=15.0, warmup=3.0,
                timeout=30.0, cpu_share=None)
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize(("kw", "words"), [
    ({"gateways": 0}, "--gateways must be >= 1"), ({"duration": 0}, "--duration must be > 0"),
    ({"cpu_share": 1.5}, "--cpu-share must be in [0.01, 1]"), ({"timeout": 0.5}, "--timeout must be >= 1"),
    ({"gateways": 3, "cpu_share": 0.5}, "more than the one CPU"),
])
def test_runs_that_cannot_measure_are_refused_naming_the_flag(monkeypatch, kw, words):
    monkeypatch.setattr(gateway_load.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(gateway_load.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert words in gateway_load._check(_args(**kw))
    assert gateway_load._check(_args()) is None


def test_without_wrk_or_a_second_cpu_it_says_what_to_do(monkeypatch):
    monkeypatch.setattr(gateway_load.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(gateway_load.shutil, "which", lambda _name: None)
    assert "apt-get install wrk" in gateway_load._check(_args())
    monkeypatch.setattr(gateway_load.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(gateway_load.os, "sched_getaffinity", lambda _pid: {0})
    assert "at least 2 CPUs" in gateway_load._check(_args())
