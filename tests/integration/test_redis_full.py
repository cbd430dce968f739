"""Redis full: at its maxmemory under noeviction (as `kvfleet up`, compose and k8s run it) it refuses every write
but reads, deletes, acks and PEXPIRE. Under a real worker and gateway, with Redis's maxmemory set below what it
holds mid-stream:
- the worker's flushes are refused, but its status is kept alive with PEXPIRE: after several status TTLs it is
  still in the fleet (before, its status expired and the fleet answered "no worker is alive", while
  `kvfleet status` called it dead and its requests were taken over);
- a new request gets 503 `redis_full` whose message says what to do, not a misleading `no_workers` (the Python
  client, and so Celery tasks, FleetUnavailable with that code: retried as a full fleet);
- the worker's /readyz says Redis is full, and it says so in its log (once, not at every retry); `kvfleet status`
  shows the worker live and Redis FULL;
- once memory is back, the stream goes on to the whole greedy answer, each token once, and new requests are
  served: nothing accepted was lost.
And a gateway's lease refresh keeps the leases that are there with PEXPIRE when Redis refuses its SETs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fleet_harness import API_KEY, REPO, Fleet

from services.call_errors import FleetUnavailable
from services.client import FleetClient
from services.ports import free_port
from shared import keys, streams
from shared.settings import Settings

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, in a land of many rivers,"
MAX_TOKENS = 600
STATUS_TTL_S = 2.0
RECOVERED = "Redis takes writes again: this worker's output goes out"  # the refusal's warning says "until Redis ..."


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    env = {"KVFLEET_HEARTBEAT_S": "0.5", "KVFLEET_STATUS_TTL_S": str(STATUS_TTL_S), "KVFLEET_LEASE_TTL_S": "3"}
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("redis-full"), env=env) as f:
        f.worker_metrics_port = free_port()
        f.start_worker("w0", "--num-kv-blocks", "128", "--metrics-port", str(f.worker_metrics_port))
        f.start_gateway()
        f.wait_ready(workers=1)
        yield f


def body(stream: bool) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def reference_and_stream(fleet: Fleet) -> tuple[str, str, threading.Thread, list[str]]:
    """The served model, its undisturbed greedy answer, and the same request streaming in a thread (started, its
    first event in) with the SSE payloads it gets."""
    with fleet.http(timeout=60) as h:
        model = h.get("/v1/models").json()["data"][0]["id"]
        reference = h.post("/v1/completions", json=body(False) | {"model": model}).json()["choices"][0]["text"]
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", fleet.url() + "/v1/completions", json=body(True) | {"model": model},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(30), fleet.tail()
    return model, reference, reader, events


def worker_log_once_recovered(fleet: Fleet, since: int) -> str:
    """w0's log from byte `since`, once it says Redis takes writes again. The worker logs that just after the write
    that carried the stream's end, so a client can see [DONE] before the line is written: wait for it."""
    def logged() -> str:
        text = fleet.logs["w0"].read_bytes()[since:].decode(errors="replace")
        return text if RECOVERED in text else ""
    return fleet.wait_for(logged, timeout_s=10, what="the worker's log to say Redis takes writes again")


def test_a_full_redis_keeps_the_worker_in_the_fleet_and_loses_nothing(fleet):
    r = streams.connect(fleet.redis.url)
    model, reference, reader, events = reference_and_stream(fleet)
    r.config_set("maxmemory", 1)  # full from now on, whatever is read and freed meanwhile
    try:
        time.sleep(4 * STATUS_TTL_S)
        assert r.get(keys.status("w0")) is not None, "the worker's status expired while Redis was full"
        assert [w["worker_id"] for w in fleet.fleet_status()["workers"]] == ["w0"]
        with fleet.http(timeout=30) as h:
            refused = h.post("/v1/completions", json=body(False) | {"model": model, "max_tokens": 4})
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
        error = refused.json()["error"]
        assert error["code"] == "redis_full" and "maxmemory" in error["message"], error
        status = subprocess.run([sys.executable, "-m", "services.cli", "status"], cwd=REPO, env=fleet.env,
                                capture_output=True, text=True, timeout=60)
        assert "FULL, it refuses writes" in status.stdout and "dead:" not in status.stdout, status.stdout
        with FleetClient(settings=Settings.from_env(redis_url=fleet.redis.url)) as client:
            with pytest.raises(FleetUnavailable) as refused_too:
                client.submit(PROMPT, max_tokens=4)
        assert refused_too.value.code == "redis_full" and "maxmemory" in refused_too.value.message
        ready = httpx.get(f"http://127.0.0.1:{fleet.worker_metrics_port}/readyz", timeout=5)
        assert ready.status_code == 503 and "redis is full" in ready.text, ready.text
        assert reader.is_alive(), "the stream ended while Redis was full"
    finally:
        r.config_set("maxmemory", 0)
    reader.join(60)
    assert not reader.is_alive() and events[-1] == "[DONE]", fleet.tail()
    payloads = [json.loads(e) for e in events[:-1]]
    assert not [p for p in payloads if "error" in p], payloads[-3:]
    assert "".join(c["text"] for p in payloads for c in p["choices"]) == reference
    log = worker_log_once_recovered(fleet, 0)
    assert log.count("Redis is full: it is at its maxmemory") == 1, fleet.tail()
    assert "left pending by" not in log
    with fleet.http(timeout=60) as h:
        again = h.post("/v1/completions", json=body(False) | {"model": model})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
    r.close()


def test_the_lease_refresh_keeps_the_leases_there_when_redis_refuses_its_sets(fleet):
    async def refresh() -> tuple[set[str], int]:
        r = streams.connect_async(fleet.redis.url)
        try:
            await r.set(keys.lease("held"), 1, px=1000)
            await r.config_set("maxmemory", 1)
            try:
                gone, full = await streams.ahold_leases(r, {"held": 0, "lapsed": 0}, 30.0)
                assert full
                return gone, await r.pttl(keys.lease("held"))
            finally:
                await r.config_set("maxmemory", 0)
        finally:
            await r.aclose()

    gone, ttl_ms = asyncio.run(refresh())
    assert gone == {"lapsed"} and ttl_ms > 20_000, (gone, ttl_ms)


def test_a_redis_that_cannot_persist_is_named_and_loses_nothing(fleet):
    """Redis unable to save to disk (MISCONF: here its RDB snapshot fails, as on a full or read-only volume) refuses
    every write, PEXPIRE too, so the worker's status lapses: nothing can keep it. What the fleet says names the
    cause instead of only "no worker": a new request's 503 `no_workers` says the worker stopped reporting and may
    be unable to write to Redis; `kvfleet status` says Redis CANNOT PERSIST; the worker's /readyz and its log say
    so (once). The stream in flight is not aborted although its lease lapsed (the gateway could not set it: that
    proves nothing), and once Redis persists again it goes on to the whole greedy answer, each token once, without
    being placed again; new requests are served."""
    r = streams.connect(fleet.redis.url)
    fleet.wait_ready(workers=1)
    gateway_log = next(path for name, path in fleet.logs.items() if name.startswith("gateway"))
    logged_before, gateway_before = fleet.logs["w0"].stat().st_size, gateway_log.stat().st_size
    model, reference, reader, events = reference_and_stream(fleet)
    data_dir, save = r.config_get("dir")["dir"], r.config_get("save")["save"]
    r.config_set("save", "3600 1")  # with a save point, a failed snapshot stops writes (stop-writes-on-bgsave-error)
    r.config_set("dir", "/proc")  # where no snapshot can be written
    try:
        r.bgsave()
        fleet.wait_for(lambda: r.info("persistence")["rdb_last_bgsave_status"] == "err", what="the failed snapshot")
        with pytest.raises(streams.RedisError) as refused:
            r.set("probe", 1)
        assert streams.cannot_persist(refused.value)
        fleet.wait_for(lambda: r.get(keys.status("w0")) is None, timeout_s=4 * STATUS_TTL_S,
                       what="the worker's status to lapse (nothing can keep it)")
        with fleet.http(timeout=30) as h:
            answer = h.post("/v1/completions", json=body(False) | {"model": model, "max_tokens": 4})
        error = answer.json()["error"]
        assert answer.status_code == 503 and error["code"] == "no_workers", answer.text
        assert "1 stopped reporting their status (w0)" in error["message"], error
        assert "cannot write to Redis (`kvfleet status`" in error["message"], error
        status = subprocess.run([sys.executable, "-m", "services.cli", "status"], cwd=REPO, env=fleet.env,
                                capture_output=True, text=True, timeout=60)
        assert "redis CANNOT PERSIST: its last RDB snapshot failed: with save points, it refuses writes (free space on " \
            "its data volume)" in status.stdout, status.stdout
        ready = httpx.get(f"http://127.0.0.1:{fleet.worker_metrics_port}/readyz", timeout=5)
        assert ready.status_code == 503 and "redis cannot persist" in ready.text, ready.text
        assert reader.is_alive(), "the stream ended while Redis could not persist"
    finally:
        r.config_set("dir", data_dir)
        r.config_set("save", save)
        r.bgsave()  # a snapshot that succeeds: Redis takes writes again
    reader.join(90)
    assert not reader.is_alive() and events[-1] == "[DONE]", fleet.tail()
    payloads = [json.loads(e) for e in events[:-1]]
    assert not [p for p in payloads if "error" in p], payloads[-3:]
    assert "".join(c["text"] for p in payloads for c in p["choices"]) == reference
    log = worker_log_once_recovered(fleet, logged_before)
    assert log.count("Redis refuses writes: it cannot save them to disk") == 1, fleet.tail()
    assert log.count(RECOVERED) == 1, fleet.tail()
    assert "its lease lapsed" not in log, fleet.tail()
    assert "placed again" not in gateway_log.read_bytes()[gateway_before:].decode(errors="replace"), fleet.tail()
    fleet.wait_ready(workers=1)
    with fleet.http(timeout=60) as h:
        again = h.post("/v1/completions", json=body(False) | {"model": model})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference
    r.close()
