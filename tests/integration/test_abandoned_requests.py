"""Abandoned requests (issue 14): a gateway holds a lease on each request it relays. SIGKILL it mid-stream
and the worker aborts the request once the lease lapsed (lease TTL + a few seconds): its blocks come back,
its output ends with an "abort" chunk, its entry is acked. A stream through a live gateway outlasts many
TTLs (its lease is refreshed), and a request the Python client placed has no lease: a job that runs to the
end even when nobody reads it. A gateway that hangs (SIGSTOP) past the TTL mid-stream finds, when it goes on,
that the worker aborted its request: it places it again after what it had relayed, and its client gets the whole
answer, each token once. A Redis that hangs past the TTL mid-stream costs nothing but the wait: the gateway
sets the lapsed lease again (the request's entry is still there) before the worker confirms the lapse, the
stream goes on where it was, and requests sent during the hang are answered after it. A gateway stopped by
SIGTERM (a rolling update) refuses new connections at once and lets its open streams run to their end before it
exits. The worker is the real one with slower forwards (tests/slow_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from fleet_harness import API_KEY, Fleet, inbox_chunks

from services.client import FleetClient
from shared import keys, streams
from shared.messages import OutputChunk, WorkerStatus
from shared.settings import Settings

pytestmark = pytest.mark.integration

WID = "w-lease"
TTL_S = 2.0
PROMPT = "Once upon a time, in a land of many rivers,"
REFERENCE_TOKENS = 300


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    env = {"KVFLEET_HEARTBEAT_S": "0.5", "KVFLEET_LEASE_TTL_S": str(TTL_S)}
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("leases"), env=env) as f:
        f.start_worker(WID, "--num-kv-blocks", "256", script="slow_worker.py")
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
        self.text, self.usage = "", None

    def run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
                self.request_id = resp.headers["x-request-id"]
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            self.usage = event["usage"]
                        if not event.get("choices"):
                            continue
                        choice = event["choices"][0]
                        self.events += 1
                        self.text += choice["text"]
                        self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as e:  # the killed gateway's stream breaks off
            self.error = e


@pytest.fixture(scope="module")
def reference(fleet) -> str:
    """The undisturbed greedy answer of REFERENCE_TOKENS tokens, which each test's disturbed stream must match: the
    same prompt each time, so it is run once (9 s of the slow worker's steps)."""
    stream = Stream(fleet, fleet.live, max_tokens=REFERENCE_TOKENS)
    stream.run()
    assert stream.error is None and stream.finish == "length", stream.error
    return stream.text


def final_chunk(r, rid: str) -> OutputChunk | None:
    """The request's final chunk: from its own stream (a request the Python client placed), or from its gateway's
    inbox (which outlives the gateway by its TTL)."""
    return next((c for c in streams.read_all_chunks(r, rid) + inbox_chunks(r, rid) if c.final), None)


def status(r) -> WorkerStatus:
    return WorkerStatus.model_validate_json(r.get(keys.status(WID)))


def idle_with_every_block_free(s: WorkerStatus) -> bool:
    """Nothing running or waiting, and every block free (prefix-cached ones count as free: they are evictable).
    Against the whole cache, not a status read earlier: the status right after a final chunk can still count
    that request's blocks (it goes out with a later flush)."""
    return s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks


def test_a_killed_gateways_request_is_aborted_once_its_lease_lapsed(fleet, r):
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
    fleet.wait_for(lambda: idle_with_every_block_free(status(r)), what="the worker to be idle with every block free")
    assert r.xpending(keys.req_stream(WID), keys.GROUP)["pending"] == 0
    assert not r.exists(keys.lease(rid))


def test_a_request_the_python_client_placed_runs_to_the_end_unread(fleet, r):
    settings = Settings.from_env(redis_url=fleet.redis.url, lease_ttl_s=TTL_S)
    with FleetClient(settings=settings) as client:
        rid = client.submit(PROMPT, max_tokens=250, temperature=0, ignore_eos=True).request_id
    assert not r.exists(keys.lease(rid))  # fire and forget: the client closed and nobody reads it
    final = fleet.wait_for(lambda: final_chunk(r, rid), timeout_s=60, what="the client's request to finish")
    assert final.finish_reason == "length" and final.usage.completion_tokens == 250


def test_a_gateway_that_hangs_past_the_lease_ttl_places_its_request_again(fleet, r, reference):
    """SIGSTOP the gateway mid-stream for longer than the lease TTL and the worker's confirmation: the worker
    aborts the request (nobody seemed to read it), its blocks come back. On SIGCONT the gateway's lease refresh
    finds the lease gone, and it places the request again after what it had relayed. Its client, which only
    waited, gets the whole greedy answer, each token once, as an undisturbed stream does."""

    hung = Stream(fleet, fleet.live, max_tokens=300)
    hung.start()
    fleet.wait_for(lambda: hung.events >= 5, what="the stream to get going")
    rid = hung.request_id
    gateway = fleet.gateways[fleet.live].pid
    os.kill(gateway, signal.SIGSTOP)
    try:
        final = fleet.wait_for(lambda: final_chunk(r, rid), timeout_s=TTL_S + 15, what="the worker to abort it")
        assert final.finish_reason == "abort", final
        fleet.wait_for(lambda: status(r).running == 0, what="the worker to let the request go")
    finally:
        os.kill(gateway, signal.SIGCONT)
    hung.join(90)
    assert not hung.is_alive(), fleet.tail()
    assert hung.error is None and hung.finish == "length", (hung.error, fleet.tail())
    assert hung.text == reference  # each token once: nothing skipped, nothing twice
    assert hung.usage["completion_tokens"] == 300, hung.usage
    log = fleet.logs[f"gateway-{fleet.live}"].read_text(errors="replace")
    assert f"placed again as {rid}~1" in log, fleet.tail()
    fleet.wait_for(lambda: idle_with_every_block_free(status(r)), what="the worker to be idle with every block free")


def test_a_redis_that_hangs_past_the_lease_ttl_fails_nothing(fleet, r, reference):
    """SIGSTOP redis-server mid-stream for 5 s (2.5 lease TTLs; under the grace and the clients' timeouts): every
    connection stays open, every command waits, the stream's lease expires. When Redis goes on, the gateway's
    refresh finds the lease gone but the request's entry still pending, and sets the lease again before the
    worker's second look: the worker goes on, nothing is placed again (before, every request in flight was),
    and the client gets the whole greedy answer, each token once. Two requests sent during the hang are
    answered whole after it. Nothing exits."""
    gateway_log = fleet.logs[f"gateway-{fleet.live}"]
    logged_before = gateway_log.stat().st_size
    hung = Stream(fleet, fleet.live, max_tokens=300)
    hung.start()
    fleet.wait_for(lambda: hung.events >= 5, what="the stream to get going")
    late = [Stream(fleet, fleet.live, max_tokens=100) for _ in range(2)]
    redis_pid = fleet.redis.proc.pid
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        for stream in late:
            stream.start()
        time.sleep(5)
        assert hung.is_alive() and not any(s.events for s in late), "answered while Redis hung"
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    for stream in (hung, *late):
        stream.join(90)
        assert not stream.is_alive(), fleet.tail()
    assert hung.error is None and hung.finish == "length", (hung.error, fleet.tail())
    assert hung.text == reference and hung.usage["completion_tokens"] == 300, hung.usage
    for stream in late:
        assert stream.error is None and stream.finish == "length", (stream.error, fleet.tail())
        assert stream.text == reference[:len(stream.text)] and stream.usage["completion_tokens"] == 100
    log = gateway_log.read_bytes()[logged_before:].decode(errors="replace")
    assert "still queued or running: set again" in log and "placed again" not in log, fleet.tail()
    assert fleet.workers[WID].poll() is None and fleet.gateways[fleet.live].poll() is None, fleet.tail()


def test_a_gateway_stopped_by_sigterm_finishes_its_open_streams_first(fleet, r, reference):
    """A rolling update (Kubernetes sends SIGTERM after preStop): the gateway stops taking connections at once,
    lets its open streams run to their end (--graceful-timeout), then exits. Its clients get whole answers, each
    token once; nothing is cancelled, placed again or lost."""
    port = fleet.start_gateway("--graceful-timeout", "60")
    gateway = fleet.gateways[port]
    fleet.wait_for(lambda: _answers(fleet.url(port)), timeout_s=60, what="the new gateway to answer")
    open_streams = [Stream(fleet, port, max_tokens=300) for _ in range(2)]
    for stream in open_streams:
        stream.start()
    fleet.wait_for(lambda: all(s.events >= 5 for s in open_streams), what="the streams to get going")
    gateway.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert fleet.wait_for(lambda: not _answers(fleet.url(port)), timeout_s=5, what="new connections refused")
    refused_after = time.monotonic() - stopped_at
    assert all(s.is_alive() and s.events < 300 for s in open_streams), "the streams ended before the gateway stopped"
    for stream in open_streams:
        stream.join(90)
        assert not stream.is_alive(), fleet.tail()
        assert stream.error is None and stream.finish == "length", (stream.error, fleet.tail())
        assert stream.text == reference and stream.usage["completion_tokens"] == 300, stream.usage
    assert gateway.wait(30) in (0, -signal.SIGTERM), fleet.tail()
    fleet.gateways.pop(port)
    log = fleet.logs[f"gateway-{port}"].read_text(errors="replace")
    assert "cancelling" not in log and "placed again" not in log, log[-3000:]
    fleet.wait_for(lambda: idle_with_every_block_free(status(r)), what="the worker to be idle with every block free")
    assert r.xpending(keys.req_stream(WID), keys.GROUP)["pending"] == 0
    print(f"\nnew connections refused {refused_after:.2f} s after SIGTERM; both open streams ran to their end")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
