"""`kvfleet bench serve` against a real fleet (Redis, one worker on the tiny model, the gateway): the JSON
report adds up, the plots are written; and the gateway's stream is OpenAI's, as standard load generators read
it (a usage-only last chunk with `choices: []` when `stream_options.include_usage`, `usage: null` before)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from fleet_harness import API_KEY, REPO, Fleet

pytestmark = pytest.mark.integration

REQUESTS, OUTPUT_LEN = 8, 6


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("bench-serve")) as f:
        f.start_worker("w0", "--num-kv-blocks", "64", "--max-num-seqs", "8")
        f.start_gateway()
        f.wait_ready(workers=1)
        yield f


def test_bench_serve_report_adds_up(fleet, tmp_path):
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("".join(
        json.dumps({"id": i, "prompt_len": 8 + i, "output_len": OUTPUT_LEN, "prefix_group": None, "prefix_len": 0})
        + "\n" for i in range(REQUESTS)))
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "services.cli", "bench", "serve", "--url", fleet.url(), "--api-key", API_KEY,
           "--model", fleet.model, "--workload", str(workload), "--concurrency", "4", "--request-rate", "50",
           "--slo", "ttft=60,tpot=60", "--json", str(out), "--no-progress", "--redis-stats", fleet.redis.url]
    proc = subprocess.run(cmd, cwd=REPO, env=fleet.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr + fleet.tail()
    assert "TTFT p99 ms" in proc.stdout and "CPU:" in proc.stdout

    report = json.loads(out.read_text())
    assert report["cpu"]["model"] and report["cpu"]["cores"] >= 1
    assert report["workload"]["num_requests"] == REQUESTS
    (run,) = report["systems"]["kvfleet"]["runs"]
    assert (run["num_requests"], run["completed"], run["failed"], run["errors"]) == (REQUESTS, REQUESTS, 0, {})
    assert run["output_tokens"] == REQUESTS * OUTPUT_LEN
    assert run["prompt_tokens"] == sum(8 + i for i in range(REQUESTS))
    assert run["request_rate"] == 50 and run["concurrency"] == 4
    assert run["output_tok_per_s"] == pytest.approx(run["output_tokens"] / run["duration_s"])
    assert run["request_throughput"] == pytest.approx(REQUESTS / run["duration_s"])
    assert run["goodput_req_per_s"] == pytest.approx(run["request_throughput"])  # a generous SLO: all meet it
    assert run["slo_met"] == REQUESTS
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = run[key]
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
    assert run["ttft_s"]["count"] == run["e2e_s"]["count"] == REQUESTS
    assert run["ttft_s"]["max"] <= run["e2e_s"]["max"]
    assert len(run["ttft_samples_s"]) == REQUESTS
    # each request streams its tokens: at least one inter-token gap each (a chunk may carry several tokens)
    assert REQUESTS <= run["itl_s"]["count"] <= REQUESTS * (OUTPUT_LEN - 1)
    redis = run["redis"]  # what the fleet's Redis did per output token (--redis-stats)
    names = redis["commands_by_name_per_token"]
    assert redis["commands_per_token"] >= sum(names.values()) > 0 and redis["bytes_per_token"] > 0
    assert redis["cpu_us_per_token"] > 0 and redis["usec_sum_per_token"] > 0
    assert "evalsha" in names and "xread" in names
    assert names.get("xpending", 0) < 0.2, "ownership is checked per flush only while the fence is down"
    assert "Redis:" in proc.stdout and "commands" in proc.stdout
    fleet_part = run["fleet"]
    assert fleet_part["workers"]["w0"]["requests"] == REQUESTS
    assert fleet_part["dead_letters"] == 0
    # with --redis-stats /v1/fleet is read only outside the measured window (its reads are not the fleet's)
    assert fleet_part["max_queue_lag"] is None and "peaks not sampled" in proc.stdout

    page = (tmp_path / "report.html").read_text()
    assert report["plot"] == str(tmp_path / "report.html") and page.count("<svg") >= 1 and "TTFT distribution" in page


def test_without_redis_stats_the_fleet_is_sampled_during_the_run(fleet, tmp_path):
    workload = tmp_path / "tiny.jsonl"
    workload.write_text("".join(json.dumps({"id": i, "prompt_len": 8, "output_len": OUTPUT_LEN, "prefix_group": None,
                                            "prefix_len": 0}) + "\n" for i in range(4)))
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "services.cli", "bench", "serve", "--url", fleet.url(), "--api-key", API_KEY,
           "--model", fleet.model, "--workload", str(workload), "--concurrency", "2", "--json", str(out),
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=fleet.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr + fleet.tail()
    (run,) = json.loads(out.read_text())["systems"]["kvfleet"]["runs"]
    assert run["fleet"]["max_queue_lag"] >= 0 and run["fleet"]["max_waiting"] >= 0 and "peak queue lag" in proc.stdout
    assert "redis" not in run


def test_stream_format_is_openais(fleet):
    body = {"model": fleet.model, "prompt": [1, 2, 3, 4], "max_tokens": 5, "min_tokens": 5, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with fleet.http(timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 and last["usage"]["prompt_tokens"] == 4
    assert last["usage"]["total_tokens"] == 9
    assert content and all(c["usage"] is None and len(c["choices"]) == 1 for c in content)
    assert all(c["object"] == "text_completion" and c["id"] == last["id"] for c in chunks)
    assert len({c["created"] for c in chunks}) == 1  # one creation time for the whole stream
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    # without include_usage no usage chunk at all
    body["stream_options"] = None
    with fleet.http(timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"]
    assert chunks and all(c["choices"] and c["usage"] is None for c in chunks)
    # chat: the role first, then content, then the usage chunk
    chat = {"model": fleet.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 3,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with fleet.http(timeout=60) as h, h.stream("POST", "/v1/chat/completions", json=chat) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])
    assert len({c["created"] for c in chunks}) == 1 and len({c["id"] for c in chunks}) == 1
    assert httpx.get(fleet.url() + "/health").status_code == 200
