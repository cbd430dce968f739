"""gpu_worker.serve.outbox against a real Redis: its writer thread runs as in a worker; the test plays the
main thread. Redis's MONITOR shows which commands went in one atomic step (a MULTI, or the flush script), so
"the ack goes with or after the final chunk" is checked on the wire, not inferred."""

from __future__ import annotations

import threading
import time

import pytest
from fleet_harness import wait_for

from gpu_worker.serve.outbox import Outbox
from shared import keys, streams
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.settings import Settings

pytestmark = pytest.mark.integration

ME = "w-out"


@pytest.fixture
def outbox(r):
    box = Outbox(r, Settings(worker_id=ME, status_ttl_s=2.0, heartbeat_s=0.3), ME).start()
    yield box
    box.close()


class Monitor:
    """The commands Redis executes meanwhile (MONITOR), as lists of words: [['MULTI'], ['XADD', ...], ...]."""

    def __init__(self, r):
        self.r, self.commands = r, []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.r.monitor() as m:
            self._ready.set()
            for event in m.listen():
                if event["command"] == "GET monitor-stop":
                    return
                words = event["command"].split()
                self.commands.append(["<lua>", *words] if event.get("client_type") == "lua" else words)

    def __enter__(self) -> Monitor:
        self._thread.start()
        self._ready.wait(5)
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.r.get("monitor-stop")
        self._thread.join(5)

    def transactions(self) -> list[list[list[str]]]:
        """The MULTI ... EXEC blocks and the commands each script ran, each block as its commands."""
        blocks, current, script = [], None, None
        for words in self.commands:
            if words[0] == "<lua>":
                if script is not None:
                    script.append(words[1:])
                continue
            script = None
            if words[0] in ("EVALSHA", "EVAL"):
                script = []
                blocks.append(script)
            elif words[0] == "MULTI":
                current = []
            elif words[0] == "EXEC":
                blocks.append(current)
                current = None
            elif current is not None:
                current.append(words)
        return blocks


def chunk(rid: str, seq: int, **kw) -> OutputChunk:
    return OutputChunk(request_id=rid, seq=seq, token_ids=[seq + 10], text=f"t{seq}", worker_id=ME, **kw)


def status(**kw) -> WorkerStatus:
    return WorkerStatus(**{"worker_id": ME, "model": "m", "max_model_len": 1024, "block_size": 16,
                           "total_blocks": 64, "free_blocks": 64, **kw})


def scripts(r) -> int:
    """Script calls Redis ran so far (each flush is one)."""
    stats = r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))


def a_pending_entry(r, rid: str) -> streams.Ack:
    """A request on this worker's stream, delivered to it (pending until acked)."""
    streams.ensure_group(r, keys.req_stream(ME))
    streams.enqueue(r, GenerationRequest(request_id=rid, prompt_token_ids=[1, 2, 3]), ME)
    [delivery] = streams.read_requests(r, ME, {keys.req_stream(ME): ">"}, count=1)
    return delivery.ack


def test_chunks_in_order_and_the_ack_with_the_final_one(r, outbox):
    ack = a_pending_entry(r, "r1")
    with Monitor(r) as mon:
        outbox.send([chunk("r1", 0), chunk("r1", 1)])
        outbox.send([chunk("r1", 2)])
        outbox.send([chunk("r1", 3, final=True, finish_reason="length")], ack)
        wait_for(lambda: r.xpending(ack.stream, keys.GROUP)["pending"] == 0, what="the ack")

    written = streams.read_all_chunks(r, "r1")
    assert [(c.seq, c.text, c.final) for c in written] == [(0, "t0", False), (1, "t1", False), (2, "t2", False),
                                                          (3, "t3", True)]
    assert r.xlen(ack.stream) == 0  # acked and deleted
    assert 0 < r.pttl(keys.out_stream("r1")) <= 3600 * 1000
    out = keys.out_stream("r1")
    acked_in = [block for block in mon.transactions() if ["XACK", ack.stream, keys.GROUP, ack.entry_id] in block]
    assert len(acked_in) == 1, mon.commands
    block = acked_in[0]
    final_xadd = max(i for i, words in enumerate(block) if words[:2] == ["XADD", out])
    assert block.index(["XACK", ack.stream, keys.GROUP, ack.entry_id]) > final_xadd
    assert ["XDEL", ack.stream, ack.entry_id] in block
    xadds = [words for b in mon.transactions() for words in b if words[:2] == ["XADD", out]]
    assert len(xadds) == 4, "each chunk written once"
    pexpires = [words for b in mon.transactions() for words in b if words[:2] == ["PEXPIRE", out]]
    assert len(pexpires) == 2, "the expiry is pushed out at the first chunk and the last, not per chunk"


def test_status_published_with_its_ttl_and_refreshed_by_the_heartbeat(r, outbox):
    outbox.set_status(status(free_blocks=40))
    raw = wait_for(lambda: r.get(keys.status(ME)), what="the status")
    first = WorkerStatus.model_validate_json(raw)
    assert first.free_blocks == 40
    assert 0 < r.pttl(keys.status(ME)) <= 2000
    assert r.sismember(keys.workers(), ME)
    later = wait_for(lambda: (s := WorkerStatus.model_validate_json(r.get(keys.status(ME)))).heartbeat
                     > first.heartbeat and s, what="a heartbeat")
    assert later.free_blocks == 40  # unchanged state, published again so it does not expire

    outbox.close()
    assert r.get(keys.status(ME)) is None, "closing removes the status: others take over at once"


def test_reservations_of_taken_requests_go_with_the_status_that_counts_them(r, outbox):
    r.hset(keys.reserved(ME), mapping={"taken-1": 3, "taken-2": 2, "still-queued": 5})
    with Monitor(r) as mon:
        outbox.set_status(status(free_blocks=59), taken=["taken-1", "taken-2"])
        wait_for(lambda: r.hlen(keys.reserved(ME)) == 1, what="the reservations to go")
    assert r.hgetall(keys.reserved(ME)) == {"still-queued": "5"}
    [block] = [b for b in mon.transactions() if any(w[0] == "HDEL" for w in b)]
    assert [w[:2] for w in block] == [["SET", keys.status(ME)], ["SADD", keys.workers()], ["HDEL", keys.reserved(ME)]]
    assert sorted(block[2][2:]) == ["taken-1", "taken-2"]
    assert WorkerStatus.model_validate_json(r.get(keys.status(ME))).free_blocks == 59


def test_a_hand_back_requeues_on_the_shared_stream_and_acks_the_entry(r, outbox):
    ack = a_pending_entry(r, "back")
    outbox.hand_back(GenerationRequest(request_id="back", prompt_token_ids=[1, 2, 3], attempt=1), ack)
    wait_for(lambda: r.xlen(keys.req_any()) == 1, what="the requeued request")
    [(_, fields)] = r.xrange(keys.req_any())
    assert streams.parse_request(fields).attempt == 1
    assert r.xlen(ack.stream) == 0 and r.xpending(ack.stream, keys.GROUP)["pending"] == 0


def test_while_chunks_flow_a_changed_status_rides_with_them_and_alone_it_still_goes_out_within_a_period(r):
    """A step every 20 ms changes the status every step: the status goes with the steps' flushes (at most
    status_max_hz times a second, never more than two periods late), not in flushes of its own (each a script
    call). With no chunks flowing, a change goes out alone one period after the last status."""
    settings = Settings(worker_id=ME, status_ttl_s=5.0, heartbeat_s=1.0, status_max_hz=20.0)
    box = Outbox(r, settings, ME).start()

    try:
        box.set_status(status(free_blocks=64, run_id=box.run_id))
        wait_for(lambda: r.get(keys.status(ME)), what="the first status")
        time.sleep(0.1)
        before, published, started = scripts(r), set(), time.monotonic()
        for step in range(50):  # 1 s of 20 ms steps, each changing the status
            box.send([chunk("flowing", step)])
            box.set_status(status(free_blocks=63 - step % 32, run_id=box.run_id))
            time.sleep(0.02)
            published.add(WorkerStatus.model_validate_json(r.get(keys.status(ME))).heartbeat)
        elapsed = time.monotonic() - started
        time.sleep(0.15)
        flushes = scripts(r) - before
        assert r.xlen(keys.out_stream("flowing")) == 50
        assert flushes <= 56, f"{flushes} flush scripts for 50 steps: the status went alone (70 before)"
        beats = sorted(published)
        assert 8 <= len(beats) <= 20 * elapsed + 2, beats  # ~20 a second, not one per step
        assert max(b - a for a, b in zip(beats, beats[1:], strict=False)) < 0.3  # two periods, and jitter

        t0 = time.time()
        box.set_status(status(free_blocks=7, run_id=box.run_id))  # no chunks now: it goes alone, within a period
        got = wait_for(lambda: (s := WorkerStatus.model_validate_json(r.get(keys.status(ME)))).free_blocks == 7
                       and s, what="the changed status")
        assert got.heartbeat - t0 < 0.2
    finally:
        box.close()


def test_one_steps_output_goes_out_in_one_flush(r):
    """The main thread queues a step's output one request at a time; inside `gathered()` the writer gets it as
    one item, so it goes out in one script call, however slowly it was queued. Queued without it, the writer
    wakes at the first request and flushes several times during the same step. What was sent inside goes out
    even when the step's output handling raises."""
    box = Outbox(r, Settings(worker_id=ME, status_ttl_s=5.0, heartbeat_s=5.0), ME).start()

    def one_step(step: int) -> None:
        for i in range(64):  # 64 requests, the emit loop slowed to ~0.5 ms per request
            box.send([chunk(f"req-{i}", step)])
            time.sleep(0.0005)

    try:
        box.set_status(status(run_id=box.run_id))
        wait_for(lambda: r.get(keys.status(ME)), what="the first status")
        time.sleep(0.1)
        before = scripts(r)
        with box.gathered():
            one_step(0)
        wait_for(lambda: all(r.xlen(keys.out_stream(f"req-{i}")) == 1 for i in range(64)), what="step 0's chunks")
        assert scripts(r) - before == 1

        before = scripts(r)
        one_step(1)
        wait_for(lambda: all(r.xlen(keys.out_stream(f"req-{i}")) == 2 for i in range(64)), what="step 1's chunks")
        assert scripts(r) - before >= 2  # what gathered() prevents

        with pytest.raises(RuntimeError), box.gathered():
            box.send([chunk("req-0", 2)])
            raise RuntimeError("the emit loop failed")
        wait_for(lambda: r.xlen(keys.out_stream("req-0")) == 3, what="the chunk sent before the error")
    finally:
        box.close()
