"""The worker's threads never die on an unexpected error (real Redis, no engine): the intake's reader carries
on after its room check raises, dead-letters entries it cannot read and keeps serving the stream; the outbox
drops only a chunk that cannot be written and keeps writing; and a worker whose thread died anyway says so
on /readyz and /livez (the worker, built around a stand-in engine: only its health answers are tested)."""

from __future__ import annotations

import json
import queue
import time
from types import SimpleNamespace

import pytest
from fleet_harness import wait_for

from gpu_worker.core.scheduler import SchedulerStats
from gpu_worker.serve import outbox as outbox_module
from gpu_worker.serve.intake import Intake, Room
from gpu_worker.serve.outbox import Outbox
from gpu_worker.serve.request_tracker import Job
from gpu_worker.serve.worker import Worker
from shared import keys, streams
from shared.messages import DeadLetter, GenerationRequest, OutputChunk
from shared.sampling_params import SamplingParams
from shared.settings import Settings

pytestmark = pytest.mark.integration

ME = "w-threads"


def request(rid: str, **params) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                             sampling_params=SamplingParams(max_tokens=4).to_dict() | params)


def test_the_intake_survives_errors_and_dead_letters_what_it_cannot_read(r):
    room_checks = {"n": 0}

    def room() -> Room:
        room_checks["n"] += 1
        if room_checks["n"] <= 3:
            raise RuntimeError("injected room failure")
        return Room(own_backlog=True, total_blocks=64, available_blocks=60, block_size=16)

    inbox: queue.Queue = queue.Queue()
    intake = Intake(r, Settings(worker_id=ME, heartbeat_s=0.2), ME, inbox, room).start()
    try:
        stream = keys.req_stream(ME)
        r.xadd(stream, {keys.FIELD: "[1, 2"})
        r.xadd(stream, {"no-field": "1"})
        streams.enqueue(r, request("wrong-version").model_copy(update={"v": 2}), ME)
        streams.enqueue(r, request("bad-params", temperature="hot"), ME)
        streams.enqueue(r, request("good"), ME)
        job = inbox.get(timeout=10)
        assert isinstance(job, Job) and job.request_id == "good"
        assert room_checks["n"] > 3 and intake.dead_threads() == []
        letters = wait_for(lambda: len(r.xrange(keys.DEAD)) >= 4 and r.xrange(keys.DEAD), what="4 dead letters")
        letters = [DeadLetter.model_validate_json(f[keys.FIELD]) for _, f in letters]
        assert sorted(d.request.request_id for d in letters if d.request) == ["bad-params", "wrong-version"]
        malformed = [d for d in letters if d.request is None]
        assert {d.raw for d in malformed} == {json.dumps({keys.FIELD: "[1, 2"}), json.dumps({"no-field": "1"})}
        assert all(d.reason.startswith("malformed request entry") for d in malformed)
        for rid, kind in (("wrong-version", "invalid_request"), ("bad-params", "invalid_request")):
            [chunk] = streams.read_all_chunks(r, rid)
            assert (chunk.final, chunk.finish_reason, chunk.error.kind) == (True, "error", kind)
        assert r.xpending(stream, keys.GROUP)["pending"] == 1  # only the good one, which the engine now holds
    finally:
        intake.stop()
        time.sleep(1.1)  # the cancel reader blocks up to 1 s


def test_the_outbox_drops_only_a_chunk_it_cannot_write_and_keeps_writing(r, monkeypatch):
    real = streams.publish

    def publish(client, worker_id, *, chunks=(), **kw):
        if any(c.request_id == "unwritable" for c in chunks):
            raise TypeError("injected: cannot serialize")
        return real(client, worker_id, chunks=chunks, **kw)

    monkeypatch.setattr(outbox_module.streams, "publish", publish)
    box = Outbox(r, Settings(worker_id=ME, status_ttl_s=2.0, heartbeat_s=0.3), ME).start()
    try:
        box.send([OutputChunk(request_id="fine", seq=0, text="a"), OutputChunk(request_id="unwritable", seq=0),
                  OutputChunk(request_id="fine", seq=1, text="b", final=True)])
        wait_for(lambda: len(streams.read_all_chunks(r, "fine")) == 2, what="the writable chunks")
        assert not r.exists(keys.out_stream("unwritable"))
        box.send([OutputChunk(request_id="after", seq=0, final=True)])
        wait_for(lambda: streams.read_all_chunks(r, "after"), what="a later chunk")
        assert box.alive and box.healthy
    finally:
        box.close()


def test_a_worker_with_a_dead_thread_is_neither_ready_nor_live():
    stats = SchedulerStats(total_blocks=8, free_blocks=8, used_blocks=0, cached_blocks=0, prefix_cache_queries=0,
                           prefix_cache_hits=0, allocated_slots=0, stored_tokens=0, fragmentation_slots=0)
    engine = SimpleNamespace(stats=lambda: stats, max_model_len=64, block_size=16)
    worker = Worker(engine, Settings(worker_id=ME), model_name="m")
    worker.outbox = SimpleNamespace(healthy=True, alive=True, refused="")
    worker.intake = SimpleNamespace(dead_threads=lambda: [], redis_failing=set())
    assert worker.ready() == (True, "ok") and worker.live()[0]
    worker.outbox.refused, worker.outbox.healthy = "full", False  # Redis full: not ready, still live
    assert worker.ready() == (False, "redis is full (maxmemory): its writes wait") and worker.live()[0]
    worker.outbox.refused, worker.outbox.healthy = "", True
    worker.intake.redis_failing.add("request read")  # Redis away: not ready, still live
    assert worker.ready() == (False, "redis unreachable (request read failing)") and worker.live()[0]
    worker.intake = SimpleNamespace(dead_threads=lambda: ["kvfleet-intake"])
    assert worker.ready() == (False, "thread(s) kvfleet-intake died")
    worker._loop()  # notices at once: gives up instead of serving deaf
    assert worker.broken == "thread(s) kvfleet-intake died"
    assert worker.ready()[0] is False and worker.live() == (False, "thread(s) kvfleet-intake died")
