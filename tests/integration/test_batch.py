"""`kvfleet batch INPUT.jsonl OUTPUT.jsonl`: OpenAI Batch API files through the fleet. A real Redis (with a
password) and a real fleet worker on the tiny model, one for the module."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from fleet_harness import REPO, Fleet

from services.batch import request_id_for, run_batch
from services.cli import main as kvfleet
from services.redis_server import RedisServer
from shared import keys, streams
from shared.settings import Settings

pytestmark = pytest.mark.integration

# Output streams outlive the test, so it can count what the fleet generated for each line.
KEEP_OUTPUT = {"KVFLEET_OUTPUT_TTL_AFTER_READ_S": "900"}


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("batch"), env=KEEP_OUTPUT) as f:
        f.start_worker("w0", "--num-kv-blocks", "512", "--max-num-seqs", "32")
        r = streams.connect(f.redis.url)
        f.wait_for(lambda: r.get(keys.status("w0")), 180, "fleet worker w0")
        r.close()
        yield f


def line(custom_id, model, i):
    if i % 2:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": f"Question {i}?"}],
                         "max_tokens": 3, "ignore_eos": True}}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": f"Line {i} of the batch", "max_tokens": 3, "ignore_eos": True}}


def read_output(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def complete_lines(path):
    return sum(1 for x in path.read_bytes().split(b"\n")[:-1] if x)


def test_200_lines_complete_and_a_rerun_after_a_kill_does_only_the_rest(fleet, tmp_path):
    """The first run is killed (SIGKILL) once about half the lines are answered; the rerun does the rest."""
    n = 200
    model = os.path.basename(fleet.model)
    ids = [f"req-{i:03d}" for i in range(n)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line(cid, model, i)) + "\n" for i, cid in enumerate(ids)))

    log = fleet.log_dir / "batch-first.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "batch", str(inp), str(out),
                                 "--concurrency", "16"], cwd=REPO, env=fleet.env, stdout=f, stderr=subprocess.STDOUT)
    try:
        fleet.wait_for(lambda: out.exists() and complete_lines(out) >= n // 2 or proc.poll() is not None, 300,
                       f"{n // 2} lines of output")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    done_before = complete_lines(out)
    assert n // 2 <= done_before < n

    # leases the killed run held while placing are stale after 1 s here (10 s by default)
    settings = Settings(redis_url=fleet.redis.url, output_ttl_after_read_s=900, job_lease_s=1)
    summary = asyncio.run(run_batch(settings, inp, out, concurrency=16, progress=False))
    assert (summary.skipped, summary.ran, summary.failed) == (done_before, n - done_before, 0)

    results = read_output(out)
    assert sorted(x["custom_id"] for x in results) == ids  # each line once
    for x in results:
        assert x["error"] is None and x["response"]["status_code"] == 200, x
        body = x["response"]["body"]
        assert body["usage"]["completion_tokens"] == 3
        assert body["id"] == x["response"]["request_id"] == request_id_for(out, x["custom_id"])
    # The fleet generated every line exactly once, including those in flight when the first run died.
    r = streams.connect(fleet.redis.url)
    for cid in ids:
        chunks = streams.read_all_chunks(r, request_id_for(out, cid))
        assert [c.seq for c in chunks] == list(range(len(chunks))) and sum(c.final for c in chunks) == 1, cid
        assert sum(len(c.token_ids) for c in chunks) == 3, cid
    r.close()


def test_errors_are_recorded_per_line_and_the_batch_goes_on(fleet, tmp_path, capsys):
    model = os.path.basename(fleet.model)
    lines = [
        json.dumps(line("ok-1", model, 0)),
        json.dumps(line("bad-url", model, 2) | {"url": "/v1/embeddings"}),
        json.dumps(line("bad-temp", model, 4) | {"body": {"model": model, "prompt": "x", "temperature": 9}}),
        "{this is not json",
        json.dumps(line("ok-1", model, 6)),  # duplicate custom_id
        json.dumps(line("ok-2", model, 1)),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    env = fleet.env["KVFLEET_REDIS_URL"]
    assert kvfleet(["batch", str(inp), str(out), "--redis-url", env, "--concurrency", "3"]) == 0
    captured = capsys.readouterr()
    assert "batch: ran 7 request(s), 5 failed; skipped 0" in captured.out
    assert "7/7" in captured.err  # the progress bar

    by_id = {}
    for x in read_output(out):
        by_id.setdefault(x["custom_id"], []).append(x)
    answered, duplicate = sorted(by_id["ok-1"], key=lambda x: "line" in x)  # output is in completion order
    assert answered["error"] is None and answered["response"]["body"]["object"] == "text_completion"
    assert duplicate["error"]["code"] == "duplicate_custom_id" and duplicate["line"] == 5
    assert by_id["ok-2"][0]["error"] is None and by_id["ok-2"][0]["response"]["body"]["object"] == "chat.completion"
    bad_url = by_id["bad-url"][0]
    assert bad_url["response"]["status_code"] == 400 and bad_url["response"]["body"]["error"]["param"] == "url"
    bad_temp = by_id["bad-temp"][0]
    assert bad_temp["response"]["body"]["error"]["param"] == "temperature"
    assert "temperature" in bad_temp["error"]["message"]
    assert by_id["no-body"][0]["response"]["body"]["error"]["param"] == "body"
    assert by_id[None][0]["error"]["code"] == "invalid_line" and by_id[None][0]["line"] == 4

    # A rerun finds every line answered.
    assert kvfleet(["batch", str(inp), str(out), "--redis-url", env, "--no-progress"]) == 0
    assert "batch: ran 0 request(s), 0 failed; skipped 7" in capsys.readouterr().out
    assert len(read_output(out)) == 7


def test_a_changed_line_under_a_used_custom_id_gets_409_not_the_first_result(fleet, tmp_path):
    """A line answered in the fleet by a run that died before writing it, then edited before the rerun: the rerun
    records a 409 for it instead of the first body's result."""
    from services.fleet_calls import FleetCaller

    model = os.path.basename(fleet.model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    settings = Settings.from_env(redis_url=fleet.redis.url)

    async def first_run():
        caller = FleetCaller(settings)
        try:
            return await caller.call("completion", line("q1", model, 0)["body"], request_id_for(out, "q1"))
        finally:
            await caller.aclose()

    assert asyncio.run(first_run())["object"] == "text_completion"
    inp.write_text(json.dumps(line("q1", model, 2)) + "\n" + json.dumps(line("q2", model, 4)) + "\n")
    summary = asyncio.run(run_batch(settings, inp, out, concurrency=2, progress=False))
    assert (summary.ran, summary.failed) == (2, 1)
    by_id = {x["custom_id"]: x for x in read_output(out)}
    changed = by_id["q1"]
    assert changed["response"]["status_code"] == 409 and changed["error"]["code"] == "request_id_conflict"
    body = changed["response"]["body"]
    assert body["error"]["param"] == "request_id" and "choices" not in body
    assert by_id["q2"]["error"] is None


def test_a_batch_rides_out_redis_restarts_and_a_longer_outage_stops_it_clearly(tiny_llama_dir, tmp_path):
    """The run starts while Redis is stopped, which comes back (on its AOF) 3 s later; once a few lines are
    answered, Redis is stopped (SIGTERM) and started again 3 s later. The same run answers every line, each once.
    Then, with Redis down past --redis-wait, the run stops with exit status 1 and a message that says what
    happened (no traceback), and a rerun once Redis is back does the rest."""
    n, tokens = 48, 64
    f = Fleet(tiny_llama_dir, tmp_path / "fleet", env=KEEP_OUTPUT)
    f.redis = RedisServer(password="p@ss:word", data_dir=str(tmp_path / "redis-data"))  # AOF, kept on stop
    with f:  # (starts this Redis; the one Fleet made is never started)
        f.start_worker("w0", "--num-kv-blocks", "512", "--max-num-seqs", "8")
        r = streams.connect(f.redis.url)
        f.wait_for(lambda: r.get(keys.status("w0")), 180, "fleet worker w0")
        r.close()
        model, port = os.path.basename(f.model), f.redis.port

        def restart_redis(after_s: float) -> None:
            f.redis.stop()  # SIGTERM: redis-server fsyncs its AOF before it exits
            time.sleep(after_s)
            f.redis.port = port
            f.redis.start()

        ids = [f"req-{i:03d}" for i in range(n)]
        inp, out, log = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "batch.log"
        inp.write_text("".join(json.dumps(line(cid, model, i) | {"body": line(cid, model, i)["body"]
                                                                  | {"max_tokens": tokens}}) + "\n"
                               for i, cid in enumerate(ids)))
        f.redis.stop()
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "batch", str(inp), str(out),
                                     "--no-progress", "--concurrency", "4"], cwd=REPO, env=f.env, stdout=fh,
                                    stderr=subprocess.STDOUT)
        try:
            time.sleep(3)
            assert proc.poll() is None, log.read_text()[-3000:]  # waiting for Redis, not ended
            f.redis.port = port
            f.redis.start()
            f.wait_for(lambda: out.exists() and complete_lines(out) >= 4 or proc.poll() is not None, 120,
                       "4 lines of output")
            assert proc.poll() is None and complete_lines(out) < n, "the batch ended before the second outage"
            restart_redis(3)
            assert proc.wait(240) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        text = log.read_text()
        assert "is unreachable" in text and "answers again" in text and "Traceback" not in text, text[-3000:]
        results = read_output(out)
        assert sorted(x["custom_id"] for x in results) == ids  # each line once
        for x in results:
            assert x["error"] is None and x["response"]["body"]["usage"]["completion_tokens"] == tokens, x

        # Redis away for longer than the run waits: it stops, saying so; the rerun does the rest.
        more = tmp_path / "more.jsonl"
        more.write_text("".join(json.dumps(line(f"more-{i}", model, i)) + "\n" for i in range(6)))
        f.redis.stop()
        began = time.monotonic()
        stopped = subprocess.run([sys.executable, "-m", "services.cli", "batch", str(more), str(out), "--no-progress",
                                  "--redis-wait", "2"], cwd=REPO, env=f.env, capture_output=True, text=True,
                                 timeout=120)
        assert stopped.returncode == 1 and time.monotonic() - began < 60, stopped.stderr[-3000:]
        assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
        assert "was unreachable for" in stopped.stderr and "run the same command again" in stopped.stderr
        f.redis.port = port
        f.redis.start()
        rerun = subprocess.run([sys.executable, "-m", "services.cli", "batch", str(more), str(out), "--no-progress"],
                               cwd=REPO, env=f.env, capture_output=True, text=True, timeout=240)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert "batch: ran 6 request(s), 0 failed" in rerun.stdout
        assert sorted(x["custom_id"] for x in read_output(out)) == sorted(ids + [f"more-{i}" for i in range(6)])
