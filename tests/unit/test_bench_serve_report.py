"""services.bench.serve_report on made-up runs: the numbers of a run, kvfleet/peer ratios, the side-by-side
table (with failures and the fleet line) and the plots of a sweep."""

import re

import pytest

from services.bench.cpu import cpu_info
from services.bench.load_gen import LoadRun, RequestResult
from services.bench.serve_report import format_table, ratios, summarize_run, write_plots
from services.bench.stats import SLO

pytestmark = pytest.mark.unit
SLO_ = SLO(ttft_s=0.5, tpot_s=0.05)


def _run(ttft: float, tpot: float, n: int = 4, duration: float = 2.0, fail: int = 0) -> LoadRun:
    out = []
    for i in range(n):
        r = RequestResult(id=i, prompt_tokens=10, expected_output_tokens=5, ttft_s=ttft * (i + 1), output_tokens=5,
                          itl_s=[tpot] * 4)
        r.e2e_s = r.ttft_s + 4 * tpot
        out.append(r)
    out += [RequestResult(id=n + i, prompt_tokens=10, expected_output_tokens=5, error="HTTP 503: no worker")
            for i in range(fail)]
    return LoadRun(results=out, duration_s=duration)


def _report(systems: dict) -> dict:
    return {"cpu": cpu_info(), "slo": {"text": SLO_.describe()}, "systems": systems,
            "workload": {"name": "w.jsonl", "num_requests": 4, "prompt_tokens": 40, "output_tokens": 20}}


def test_summarize_run():
    s = summarize_run(_run(0.2, 0.04, fail=1), rate=float("inf"), concurrency=8, slo=SLO_, fleet=None)
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["errors"] == {"HTTP 503: no worker": 1} and s["request_rate"] is None
    assert s["output_tokens"] == 20 and s["prompt_tokens"] == 40
    assert s["output_tok_per_s"] == 10.0 and s["total_tok_per_s"] == 30.0 and s["request_throughput"] == 2.0
    assert s["slo_met"] == 2 and s["goodput_req_per_s"] == 1.0  # TTFTs 0.2, 0.4 meet it; 0.6, 0.8 do not
    assert s["tpot_s"]["p50"] == pytest.approx(0.04) and s["itl_s"]["count"] == 16
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["ttft_samples_s"] == [0.2, 0.4, 0.6, 0.8]


def test_side_by_side_table_ratios_and_plots(tmp_path):
    ours = [summarize_run(_run(0.1, 0.02), rate=r, concurrency=None, slo=SLO_,
                          fleet={"workers": {"w0": {"requests": 4, "generation_tokens": 20, "preemptions": 0}},
                                 "max_queue_lag": 3, "max_waiting": 2}) for r in (1.0, 2.0)]
    peer = [summarize_run(_run(0.2, 0.04, duration=4.0, fail=1), rate=r, concurrency=None, slo=SLO_, fleet=None)
            for r in (1.0, 2.0)]
    (first, _) = ratios(ours, peer)
    assert first["output_tok_per_s"] == pytest.approx(2.0) and first["ttft_s_p50"] == pytest.approx(0.5)
    report = _report({"kvfleet": {"endpoint": "http://a", "config": "(kvfleet up)", "runs": ours},
                      "vllm": {"endpoint": "http://b", "config": "(vllm)", "runs": peer}})
    table = format_table(report)
    assert table.count("load: 4 requests, Poisson") == 2 and "kvfleet/vLLM" in table
    assert re.search(r"output tokens/s\s+10\.0\s+5\.0\s+2\.00x", table), table
    assert "vLLM failed 1x: HTTP 503: no worker" in table and "peak queue lag 3" in table
    page = write_plots(report, tmp_path / "p.html").read_text()
    assert page.count("<svg") == 5  # TTFT, TPOT, E2E and throughput against rate; the TTFT CDF
    assert "kvfleet @ 2 req/s" in page and "vLLM p99" in page


def test_a_failed_peer_is_shown_not_hidden():
    ours = [summarize_run(_run(0.1, 0.02), rate=float("inf"), concurrency=4, slo=SLO_, fleet=None)]
    report = _report({"kvfleet": {"endpoint": "http://a", "config": "", "runs": ours},
                      "vllm": {"endpoint": None, "config": "", "error": "vLLM exited with code 1", "runs": []}})
    assert "vLLM: failed: vLLM exited with code 1" in format_table(report)
    assert ratios(ours, []) == []
