"""The private Redis of `kvfleet up`: AOF in its data directory, a password that no unauthenticated client
gets past and that `ps` never shows, a memory cap without eviction; and `kvfleet up` started again on the same
--data-dir answers a request that was queued before (while no worker ran, then Redis was killed)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from fleet_harness import wait_for

from services import job_record, private_redis
from services.client import FleetClient
from services.fleet_calls import FleetCaller
from services.ports import free_port
from services.supervisor import REDIS_POLICY, ChildRestarts
from shared.settings import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_private_redis_persists_and_requires_its_password(tmp_path):
    data = tmp_path / "redis"
    server = private_redis.start(str(data), "64mb")
    try:
        assert oct(data.stat().st_mode & 0o777) == "0o700"
        url_file = data / private_redis.URL_FILE
        assert oct(url_file.stat().st_mode & 0o777) == "0o600" and url_file.read_text().strip() == server.url
        password = server.password
        assert password and len(password) >= 32
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
            assert password.encode() not in f.read(), "the password shows in argv"
        assert "***" in private_redis.describe(server) and password not in private_redis.describe(server)

        with pytest.raises(RuntimeError, match=rf"redis-server \(pid {server.proc.pid}\) still runs on the data"):
            private_redis.start(str(data), "64mb")  # a second server on the same AOF would corrupt it
        with pytest.raises(redis.exceptions.AuthenticationError, match="(?i)auth"):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port, password="wrong").ping()

        r = redis.Redis.from_url(server.url, decode_responses=True)
        config = r.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert config["maxmemory"] == str(64 * 1024 * 1024) and config["maxmemory-policy"] == "noeviction"
        assert config["bind"] == "127.0.0.1" and Path(config["dir"]) == data
        r.set("kept", "yes")
        wait_for(lambda: b"kept" in (data / "appendonly.aof").read_bytes(), 60, "the AOF to hold the write")
        r.close()

        pid, port = server.proc.pid, server.port
        os.kill(pid, signal.SIGKILL)
        server.proc.wait(10)

        said, record = [], ChildRestarts(REDIS_POLICY)
        wait_for(lambda: private_redis.keep(server, record, lambda m, err=False: said.append(m)) and server.proc,
                 60, "the private Redis to start again")
        assert server.port == port and server.proc.pid != pid
        assert "killed by SIGKILL; starting it again on port" in said[0] and "running again" in said[-1]
        r = redis.Redis.from_url(server.url, decode_responses=True)
        assert r.get("kept") == "yes", "the restarted Redis lost its AOF data"
        r.close()
    finally:
        private_redis.stop(server)
    assert not (data / private_redis.URL_FILE).exists() and not (data / "redis.conf").exists()
    assert (data / "appendonly.aof").exists()


def test_up_again_on_the_same_data_dir_answers_a_queued_request(tiny_llama_dir, tmp_path):
    """Queued while no worker ran, Redis then SIGKILLed: `kvfleet up --data-dir` on the same directory finds the
    request (its job record and its stream entry) and a worker answers it."""
    data, model = tmp_path / "redis", str(tiny_llama_dir)
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    server = private_redis.start(str(data), "64mb")
    try:
        settings = Settings.from_env(redis_url=server.url, model=model, queue_when_no_workers=True)
        with FleetClient(settings=settings) as client:
            rid = client.submit("queued before the restart", **params).request_id
        # the record says "enqueued" once the request is in its stream: both written to the AOF. (The request id
        # alone shows up with the "placing" record first; with appendfsync everysec Redis may write the rest up to
        # 2 s after it answered, while a background fsync runs, and a SIGKILL then loses it.)
        wait_for(lambda: re.search(rid.encode() + rb"[\s\S]*enqueued", (data / "appendonly.aof").read_bytes()), 60,
                 "the AOF to hold the request and its enqueued record")
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
    finally:
        private_redis.stop(server)

    log, port = tmp_path / "up.log", free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", KVFLEET_STATUS_TTL_S="2", KVFLEET_HEARTBEAT_S="0.5")
    env.pop("KVFLEET_REDIS_URL", None)
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--workers", "1", "--port", str(port),
                               "--model", model, "--num-kv-blocks", "64", "--data-dir", str(data), "--drain-timeout",
                               "5"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: "kvfleet: ready" in log.read_text(), 180, "the fleet to come up", log)
        text = log.read_text()
        assert re.search(r"private Redis at redis://:\*\*\*@127\.0\.0\.1:\d+/0 \(pid \d+\)", text), text
        url = (data / private_redis.URL_FILE).read_text().strip()
        assert url.split("@")[0].split(":")[-1] not in text, "the password was printed"

        async def record():
            caller = FleetCaller(Settings.from_env(redis_url=url, model=model))
            try:
                return await job_record.get(caller.redis, rid)
            finally:
                await caller.aclose()

        rec = asyncio.run(record())
        assert rec is not None and rec.state in ("enqueued", "done"), f"the queued request was lost: {rec}"
        with FleetClient(url, submit_timeout_s=60) as client:
            body = client.submit("queued before the restart", request_id=rid, **params).result(timeout=120)
        assert body["id"] == rid and body["usage"]["completion_tokens"] == 4
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGTERM)
        up.wait(90)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert not (data / private_redis.URL_FILE).exists() and (data / "appendonly.aof").exists()
