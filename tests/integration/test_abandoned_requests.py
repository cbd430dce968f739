"""Abandoned requests (issue 14): a gateway holds a lease on each request it relays. SIGKILL it mid-stream
and the worker aborts the request once the lease lapsed (lease TTL + a few seconds): its blocks come back,
its output ends with an "abort" chunk, its entry is acked. A stream through a live gateway outlasts many
TTLs (its lease is refreshed), and a request the Python client placed has no lease: a job that runs to the
end even when nobody reads it. The worker is the real one with slower forwards (tests/slow_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fleet_harness import API_KEY, REPO, Fleet, inbox_chunks

from services.client import FleetClient
from shared import keys, streams
from shared.messages import OutputChunk, WorkerStatus
from shared.settings import Settings

pytestmark = pytest.mark.integration

WID = "w-lease"
TTL_S = 2.0
PROMPT = "Once upon a time, in a land of many rivers,"


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    env = {"KVFLEET_HEARTBEAT_S": "0.5", "KVFLEET_LEASE_TTL_S": str(TTL_S)}
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("leases"), env=env) as f:
        log = f.log_dir / f"{WID}.log"
        f.logs[WID] = log
        with open(log, "ab") as out:
            f.workers[WID] = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent.parent / "slow_worker.py"), "--model", f.model,
                 "--worker-id", WID, "--num-kv-blocks", "256"], cwd=REPO, env=f.env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        f.doomed, f.live = f.start_gateway(), f.start_gateway()
        f.wait_ready(workers=1)
        yield f


@pytest.fixture
def r(fleet):
    client = streams.connect(fleet.redis.url)
    yield client
    client.close()


class Stream(threading.Thread):
    """A streaming completion through one gateway: its request id and the token events it got."""

    def __init__(self, fleet: Fleet, port: int, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.model = fleet.url(port), max_tokens, fleet.model
        self.request_id, self.events, self.finish, self.error = None, 0, None, None

    def run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
                self.request_id = resp.headers["x-request-id"]
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        self.events += 1
                        self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as e:  # the killed gateway's stream breaks off
            self.error = e


def final_chunk(r, rid: str) -> OutputChunk | None:
    """The request's final chunk: from its own stream (a request the Python client placed), or from its gateway's
    inbox (which outlives the gateway by its TTL)."""
    return next((c for c in streams.read_all_chunks(r, rid) + inbox_chunks(r, rid) if c.final), None)


def status(r) -> WorkerStatus:
    return WorkerStatus.model_validate_json(r.get(keys.status(WID)))


def test_a_killed_gateways_request_is_aborted_once_its_lease_lapsed(fleet, r):
    free_before = status(r).free_blocks
    doomed, live = Stream(fleet, fleet.doomed, max_tokens=900), Stream(fleet, fleet.live, max_tokens=250)
    doomed.start()
    live.start()
    fleet.wait_for(lambda: doomed.events >= 5 and live.events >= 5, what="both streams to get going")
    rid = doomed.request_id
    assert r.exists(keys.lease(rid)) and r.pttl(keys.lease(rid)) <= TTL_S * 1000

    os.kill(fleet.gateways[fleet.doomed].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    final = fleet.wait_for(lambda: final_chunk(r, rid), timeout_s=TTL_S + 15, what="the abort chunk")
    aborted_after = time.monotonic() - killed_at
    doomed.join(10)
    assert doomed.error is not None or doomed.finish is None, "the killed gateway's client saw no clean end"

    chunks = inbox_chunks(r, rid)
    generated = sum(len(c.token_ids) for c in chunks)
    assert final.finish_reason == "abort" and final.error is None, final
    assert generated < 900, f"the worker generated all {generated} tokens for nobody"
    assert aborted_after < TTL_S + 10, f"aborted {aborted_after:.1f}s after the kill"
    assert r.xpending(keys.req_stream(WID), keys.GROUP)["pending"] <= 1  # the live stream's entry at most

    live.join(60)
    assert live.error is None and live.finish == "length" and live.events == 250, \
        "a stream through a live gateway keeps its lease for longer than the TTL"
    fleet.wait_for(lambda: (s := status(r)).running == 0 and s.waiting == 0 and s.free_blocks == free_before,
                   what="the worker to be idle with every block free")
    assert r.xpending(keys.req_stream(WID), keys.GROUP)["pending"] == 0
    assert not r.exists(keys.lease(rid))


def test_a_request_the_python_client_placed_runs_to_the_end_unread(fleet, r):
    settings = Settings.from_env(redis_url=fleet.redis.url, lease_ttl_s=TTL_S)
    with FleetClient(settings=settings) as client:
        rid = client.submit(PROMPT, max_tokens=250, temperature=0, ignore_eos=True).request_id
    assert not r.exists(keys.lease(rid))  # fire and forget: the client closed and nobody reads it
    final = fleet.wait_for(lambda: final_chunk(r, rid), timeout_s=60, what="the client's request to finish")
    assert final.finish_reason == "length" and final.usage.completion_tokens == 250
