"""Keys of another Redis type in kvfleet's names (another program's write: a string where kvfleet keeps a stream or a
set), under a real worker and two real gateways. Before, each stopped the fleet or was misnamed:
- the shard's shared stream as a string failed every read of the worker, its own stream's too: an accepted request
  waited until its client gave up;
- the worker's own stream as a string: every request was a 503 "Redis is unavailable" (Redis was up);
- the workers set or kvfleet:shards as a string: the same 503, for every request;
- kvfleet:cancel as a string stopped the worker's cancel reader and its lease checks;
- kvfleet:dead or a gateway's inbox of another type failed every flush of the worker: all its output stopped.
Now each is named (the 503's message, `kvfleet status`, the logs: the key, what it holds, what to do), the fleet
serves whatever does not need that key, and once the key is deleted it goes on by itself: kvfleet deletes no key
it did not write."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from fleet_harness import REPO, Fleet

from shared import keys, streams
from shared.messages import GenerationRequest, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, in a land of many rivers,"


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    env = {"KVFLEET_HEARTBEAT_S": "0.5", "KVFLEET_STATUS_TTL_S": "2"}
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("key-types"), env=env) as f:
        f.start_worker("w0", "--num-kv-blocks", "128")
        f.start_gateway()
        f.start_gateway()
        f.wait_ready(workers=1)
        f.r = streams.connect(f.redis.url)
        f.reference = complete(f)
        assert f.reference.status_code == 200, f.reference.text
        yield f
        f.r.close()


def complete(fleet: Fleet, port: int | None = None, timeout: float = 30) -> httpx.Response:
    with fleet.http(port, timeout=timeout) as h:
        return h.post("/v1/completions", json={"model": fleet.model, "prompt": PROMPT, "max_tokens": 12,
                                               "temperature": 0})


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@contextmanager
def foreign(fleet: Fleet, key: str) -> Iterator[None]:
    """`key` holds a string while inside; then an operator deletes it, as the message says (nothing restored)."""
    fleet.r.delete(key)
    fleet.r.set(key, "another program's value")
    try:
        yield
    finally:
        fleet.r.delete(key)


def named_in_log(fleet: Fleet, who: str, key: str, kind: str = "string", keeps: str = "stream") -> bool:
    return any(f"Redis key '{key}' holds a {kind} where kvfleet keeps a {keeps}" in line and "DEL" in line
               for line in fleet.logs[who].read_text(errors="replace").splitlines())


def group_of(fleet: Fleet, stream: str) -> bool:
    try:
        return any(g["name"] == keys.GROUP for g in fleet.r.xinfo_groups(stream))
    except streams.RedisError:
        return False


@pytest.mark.parametrize("which", ["the shared stream", "the worker's own stream"])
def test_a_request_stream_of_another_type_is_read_around_and_its_requests_are_served(fleet, which):
    key = keys.req_any(0) if which == "the shared stream" else keys.req_stream("w0", 0)
    with foreign(fleet, key):
        # the worker meets it (an idle worker looks at both streams), then reads its other stream: its own, or the
        # shared one the gateway falls back to
        fleet.wait_for(lambda: named_in_log(fleet, "w0", key), what="the worker's log naming the key")
        for _ in range(3):
            assert text(complete(fleet)) == text(fleet.reference)
        if which == "the worker's own stream":  # the gateway routed around it, and says why
            assert any(named_in_log(fleet, name, key) for name in fleet.logs if name.startswith("gateway"))
            # ... and remembers for a while: no enqueue into that stream (a failed XADD each) at every request
            fleet.r.config_resetstat()
            began = time.monotonic()
            for _ in range(5):
                assert text(complete(fleet)) == text(fleet.reference)
            tries = fleet.r.info("commandstats").get("cmdstat_xadd", {}).get("failed_calls", 0)
            assert tries <= 1 + int((time.monotonic() - began) / streams.RECHECK_S), tries
    # deleted: the worker makes its group again, and requests go on as before
    fleet.wait_for(lambda: group_of(fleet, key), what=f"the worker's group on {key} again")
    assert text(complete(fleet)) == text(fleet.reference)
    assert fleet.workers["w0"].poll() is None


@pytest.mark.parametrize("key", [keys.workers(0), keys.SHARDS])
def test_a_fleet_set_of_another_type_is_read_around_and_named_by_kvfleet_status(fleet, key):
    """The gateways and the services find the live workers by their status keys and go on serving; `kvfleet status`
    and GET /v1/fleet name the key (exit status 1). Before, every request got a 503 naming it: one stray write kept
    the whole fleet from taking requests."""
    from services.client import FleetClient

    with foreign(fleet, key):
        fleet.wait_for(lambda: complete(fleet) and any(named_in_log(fleet, name, key, keeps="set")
                                                       for name in fleet.logs if name.startswith("gateway")),
                       what="a gateway's log naming the key")
        for port in fleet.gateways:
            assert text(complete(fleet, port)) == text(fleet.reference)
        with FleetClient(fleet.redis.url) as client:
            assert client.submit(PROMPT, max_tokens=12, temperature=0).result(timeout=60)["choices"][0]["text"] == \
                text(fleet.reference)
        status = subprocess.run([sys.executable, "-m", "services.cli", "status"], cwd=REPO, env=fleet.env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 1, status
        said = " ".join(status.stdout.split())
        assert f"Redis key '{key}' holds a string where kvfleet keeps a set" in said, status.stdout
        assert f"redis-cli DEL '{key}'" in said and "w0" in status.stdout, status.stdout  # the live worker, listed
        with fleet.http() as h:
            snap = h.get("/v1/fleet").json()
        assert [w["worker_id"] for w in snap["workers"]] == ["w0"], snap
        assert len(snap["keys_of_another_type"]) == 1 and key in snap["keys_of_another_type"][0], snap
    # deleted: the worker is back in its shard's workers set with its next status, and nothing is named any more
    fleet.wait_for(lambda: fleet.r.sismember(keys.workers(0), "w0"), what="the worker in its set again")
    assert text(complete(fleet)) == text(fleet.reference)
    status = subprocess.run([sys.executable, "-m", "services.cli", "status"], cwd=REPO, env=fleet.env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "KEY OF ANOTHER TYPE" not in status.stdout, status


def test_cancels_of_another_type_leave_the_worker_serving(fleet):
    with foreign(fleet, keys.CANCEL):
        fleet.wait_for(lambda: named_in_log(fleet, "w0", keys.CANCEL), what="the worker's log naming kvfleet:cancel")
        assert text(complete(fleet)) == text(fleet.reference)
    assert text(complete(fleet)) == text(fleet.reference)


def test_dead_letters_of_another_type_leave_the_failed_request_answered_and_the_output_flowing(fleet):
    with foreign(fleet, keys.DEAD):
        request = GenerationRequest(request_id="poison-dead", prompt_token_ids=[1, 2, 3], v=999,
                                    sampling_params=SamplingParams(max_tokens=2).to_dict())
        streams.enqueue(fleet.r, request, None)  # a version this worker cannot read: it dead-letters it
        final = [c for c in streams.iter_output(fleet.r, "poison-dead", timeout_s=30) if c.final]
        assert final and final[0].error is not None and "schema version" in final[0].error.message
        fleet.wait_for(lambda: named_in_log(fleet, "w0", keys.DEAD), what="the worker's log naming kvfleet:dead")
        assert text(complete(fleet)) == text(fleet.reference)  # the outbox did not stop on it
    assert fleet.r.type(keys.DEAD) == "none"  # no dead letter was written over it


def test_a_gateways_inbox_of_another_type_is_named_there_and_the_others_output_flows(fleet):
    first, second = list(fleet.gateways)
    inbox = next(k for k in fleet.r.scan_iter(keys.inbox("*", 0)) if is_of(fleet, first, k))
    with foreign(fleet, inbox):
        # the first gateway can get no output back: its requests get a 503 naming its inbox, not a wait
        fleet.wait_for(lambda: complete(fleet, first).status_code == 503, what="the first gateway's 503")
        error = complete(fleet, first).json()["error"]
        assert error["code"] == "redis_key_of_another_type" and inbox in error["message"]
        # the worker's flushes go on for the second gateway
        assert text(complete(fleet, second)) == text(fleet.reference)
    fleet.wait_for(lambda: complete(fleet, first).status_code == 200, what="the first gateway serving again")
    assert text(complete(fleet, first)) == text(fleet.reference)


def is_of(fleet: Fleet, port: int, inbox: str) -> bool:
    """The inbox key is the gateway's on `port` (its id: host, pid, a random part)."""
    return f"-{fleet.gateways[port].pid}-" in inbox


def test_a_flush_writes_past_an_output_stream_of_another_type(fleet):
    """A services' request's output stream, and a gateway's inbox, of another type in one flush with others'
    chunks: those others are written and acked, where the WRONGTYPE failed the whole flush every time."""
    r = fleet.r
    r.set(keys.out_stream("foreign-out"), "x")
    r.set(keys.inbox("gone-gw"), "x")
    try:
        from shared.messages import OutputChunk

        chunks = [OutputChunk(request_id=rid, seq=0, token_ids=[5], text="a", final=True)
                  for rid in ("foreign-out", "fine-out", "to-gone")]
        for run_id in ("", "run"):  # _FLUSH, then _FLUSH_FENCED (its fence: a status of this run)
            r.delete(keys.out_stream("fine-out"))
            if run_id:
                r.set(keys.status("wx"), '{"run_id": "run"}')
            assert streams.publish(r, "wx", output_ttl_s=60, chunks=chunks, reply_to={"to-gone": "gone-gw"},
                                   run_id=run_id) == []
            assert [c.text for c in streams.read_all_chunks(r, "fine-out")] == ["a"]
            assert r.type(keys.out_stream("foreign-out")) == "string" == r.type(keys.inbox("gone-gw"))
    finally:
        r.delete(keys.out_stream("foreign-out"), keys.inbox("gone-gw"), keys.status("wx"), keys.out_stream("fine-out"))


def test_a_stream_in_flight_and_new_requests_go_on_while_the_workers_set_is_of_another_type(fleet):
    """A streaming request placed before the key went bad runs to its end, and one placed after it is served."""
    got: list[str] = []

    def stream() -> None:
        with fleet.http(timeout=60) as h, h.stream("POST", "/v1/completions", json={
                "model": fleet.model, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            got.extend(line for line in resp.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    fleet.wait_for(lambda: got, what="the first streamed chunk")
    with foreign(fleet, keys.workers(0)):
        assert text(complete(fleet)) == text(fleet.reference)
        t.join(60)
    assert got[-1] == "data: [DONE]" and not [line for line in got if '"error"' in line], got[-3:]


def test_a_dead_workers_stream_of_another_type_is_read_around_and_forgotten_once_gone(fleet):
    """The takeover scan of the worker meets a dead worker (in its shard's set, no status) whose stream is a string:
    it goes on reading its own, and once that key is gone it forgets the dead worker (before, every read turn of
    every worker of the shard failed on it)."""
    stream = keys.req_stream("w-gone", 0)
    fleet.r.sadd(keys.workers(0), "w-gone")
    with foreign(fleet, stream):
        fleet.wait_for(lambda: named_in_log(fleet, "w0", stream), what="the worker's log naming the dead one's stream")
        for _ in range(3):
            assert text(complete(fleet)) == text(fleet.reference)
        assert fleet.r.sismember(keys.workers(0), "w-gone")
    fleet.wait_for(lambda: not fleet.r.sismember(keys.workers(0), "w-gone"), what="the dead worker forgotten")
    assert text(complete(fleet)) == text(fleet.reference)


def test_a_dead_workers_requests_are_taken_over_while_the_workers_set_is_of_another_type(fleet):
    """A worker died holding a request (pending on it, its status gone) while its shard's workers set holds a string:
    the live worker finds it by its request stream and claims the request, which its reader gets whole. Before, the
    takeover scan stopped while the set was bad, and the request waited until an operator deleted the key."""
    r, stream, rid = fleet.r, keys.req_stream("w-died", 0), "held-by-a-dead-worker"
    streams.ensure_group(r, stream)
    streams.enqueue(r, GenerationRequest(request_id=rid, prompt_token_ids=[5, 17, 30, 9], sampling_params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True).to_dict()), "w-died")
    assert len(streams.read_requests(r, "w-died", {stream: ">"}, count=1)) == 1  # then it died
    with foreign(fleet, keys.workers(0)):
        chunks = list(streams.iter_output(r, rid, timeout_s=30))
        assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].final and chunks[-1].error is None, chunks
        assert "left pending by w-died" in fleet.logs["w0"].read_text(errors="replace"), fleet.tail()
        # and forgotten once nothing is pending on it (the prune's SREM from the set goes past the string), once:
        # not again at every takeover scan (each heartbeat) while its stream's SCAN is cached (chaos seed 227)
        fleet.wait_for(lambda: not r.exists(stream), what="the dead worker forgotten")
        time.sleep(1.5)
        assert fleet.logs["w0"].read_text(errors="replace").count("forgot dead worker w-died") == 1, fleet.tail()
    fleet.wait_for(lambda: r.sismember(keys.workers(0), "w0"), what="the worker in its set again")


def test_a_worker_that_dies_after_its_workers_set_was_deleted_is_taken_over(fleet):
    """The operator deletes the workers set of another type: the live workers add themselves back with their next
    status, but a worker alive meanwhile that dies later was in no set, and nobody would have taken its requests
    over. The takeover scan adds back the workers it found by their streams while it read around the set."""
    r, stream, rid = fleet.r, keys.req_stream("w-late", 0), "held-by-a-worker-that-dies-later"
    streams.ensure_group(r, stream)
    streams.enqueue(r, GenerationRequest(request_id=rid, prompt_token_ids=[5, 17, 30, 9], sampling_params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True).to_dict()), "w-late")
    assert len(streams.read_requests(r, "w-late", {stream: ">"}, count=1)) == 1
    alive = WorkerStatus(worker_id="w-late", model="another", max_model_len=4096, block_size=16, total_blocks=64,
                         free_blocks=64)
    r.set(keys.status("w-late"), alive.model_dump_json(), px=6000)  # alive for 6 s, then dead
    with foreign(fleet, keys.workers(0)):
        time.sleep(2)  # the takeover scan reads around the set (every heartbeat, 0.5 s): w-late is alive
        assert not r.exists(keys.out_stream(rid))
    fleet.wait_for(lambda: r.sismember(keys.workers(0), "w-late"), what="w-late added back to the set")
    chunks = list(streams.iter_output(r, rid, timeout_s=30))  # once its status expired: taken over
    assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].final and chunks[-1].error is None, chunks
    fleet.wait_for(lambda: not r.exists(stream), what="the dead worker forgotten")


def test_a_services_request_whose_output_stream_is_of_another_type_fails_at_once_naming_it(fleet):
    """The worker writes past the output stream (its other requests' output flows), so the request's reader would
    wait for chunks that never come: it fails at once with the key named (Celery's task, the Python client)."""
    from services.call_errors import GenerationFailed
    from services.client import FleetClient

    rid = "services-foreign-out"
    with foreign(fleet, keys.out_stream(rid)), FleetClient(fleet.redis.url) as client:
        handle = client.submit(PROMPT, max_tokens=12, temperature=0, request_id=rid)
        began = time.monotonic()
        with pytest.raises(GenerationFailed) as failed:
            handle.result(timeout=60)
        assert time.monotonic() - began < 10, "it waited out the Redis grace or the request timeout"
        assert failed.value.code == "redis_key_of_another_type" and failed.value.status_code == 503
        assert f"Redis key '{keys.out_stream(rid)}' holds a string where kvfleet keeps a stream" in str(failed.value)
        assert text(complete(fleet)) == text(fleet.reference)  # the others' output flows
