"""gpu_worker.serve.intake against a real Redis, no engine: its reader threads run as in a worker, the test
plays the main thread (it sets the Room and takes Jobs from the inbox) and the rest of the fleet (gateways
enqueueing, workers that died with requests pending)."""

from __future__ import annotations

import json
import queue
import time

import pytest
from fleet_harness import wait_for

from gpu_worker.serve.intake import Cancel, Intake, Room
from gpu_worker.serve.request_tracker import Job
from shared import keys, streams
from shared.messages import DeadLetter, GenerationRequest, OutputChunk, WorkerStatus
from shared.sampling_params import SamplingParams
from shared.settings import Settings

pytestmark = pytest.mark.integration

ME = "w-me"
QUIET_S = 0.6  # several read turns of the intake: long enough to see it leave something alone


@pytest.fixture
def start_intake(r, redis_url):
    """start_intake(room, **settings) -> the running Intake (stopped after the test) and its inbox. Its client is
    the worker's: one that never sends a command twice."""
    started: list[Intake] = []

    def start(room: Room, **settings) -> tuple[Intake, queue.Queue]:
        inbox: queue.Queue = queue.Queue()
        cfg = Settings(**{"worker_id": ME, "heartbeat_s": 0.2} | settings)
        intake = Intake(streams.connect(redis_url, resend=False), cfg, ME, inbox, lambda: room).start()
        started.append(intake)
        return intake, inbox

    yield start
    for intake in started:
        intake.stop()
    time.sleep(1.1)  # the cancel reader blocks up to 1 s: let it see the stop before the next test flushes


def request(rid: str, prompt_len: int = 3, max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=list(range(5, 5 + prompt_len)),
                             sampling_params=SamplingParams(max_tokens=max_tokens).to_dict())


def roomy(**kw) -> Room:
    """A worker with nothing running and plenty of free blocks (every field can be overridden)."""
    return Room(**{"own_backlog": True, "spare": True, "total_blocks": 64, "available_blocks": 60,
                   "block_size": 16, "idle": True, **kw})


def next_job(inbox: queue.Queue, timeout_s: float = 5.0) -> Job:
    item = inbox.get(timeout=timeout_s)
    assert isinstance(item, Job), item
    return item


def alive(r, worker: str) -> None:
    """`worker` publishes a status that lives a minute: to the intake it is alive."""
    streams.publish(r, worker, output_ttl_s=60, status_ttl_s=60, status=WorkerStatus(
        worker_id=worker, model="m", max_model_len=1024, block_size=16, total_blocks=64, free_blocks=64))


def take_jobs(intake: Intake, inbox: queue.Queue, room: Room, n: int) -> dict[str, Job]:
    """The next n Jobs by request id, each accounted as the main thread would (so the intake may look again)."""
    jobs: dict[str, Job] = {}
    while len(jobs) < n:
        job = next_job(inbox)
        jobs[job.request_id] = job
        room.accounted = intake.handed
    return jobs


def deliver_to(r, consumer: str, stream: str, n: int = 1) -> list[streams.Delivery]:
    """`consumer` (a worker about to die) reads n entries of `stream`: they are pending on it."""
    return streams.read_requests(r, consumer, {stream: ">"}, count=n)


def final_chunks(r, rid: str) -> list[OutputChunk]:
    return [c for c in streams.read_all_chunks(r, rid) if c.final]


def test_reads_its_own_stream_and_the_shared_one_only_with_room(r, start_intake):
    streams.ensure_group(r, keys.req_any())
    streams.enqueue(r, request("own-1"), ME)
    streams.enqueue(r, request("shared-1"), None)
    room = roomy(spare=False, idle=False)
    intake, inbox = start_intake(room)

    job = next_job(inbox)
    assert (job.request_id, job.stream, job.deliveries) == ("own-1", keys.req_stream(ME), 1)
    time.sleep(QUIET_S)
    assert inbox.empty(), "no spare room: the shared stream is left to others"

    room.accounted, room.spare, room.available_blocks = intake.handed, True, 2  # reserve_blocks 2: 0 to spare
    time.sleep(QUIET_S)
    assert inbox.empty(), "the shared head (1 block) does not fit what this busy worker has free"
    assert streams.shared_heads(r)

    room.available_blocks = 60
    job = next_job(inbox)
    assert (job.request_id, job.stream, job.deliveries) == ("shared-1", keys.req_any(), 1)
    assert streams.shared_heads(r) == []


def test_a_look_at_the_shared_stream_takes_as_many_as_fit_in_order(r, start_intake):
    """With room, one look takes the shared stream's oldest requests, in order, as many as the worker's free
    sequence slots and free blocks hold; the rest stay for its next look, or for another worker."""
    streams.ensure_group(r, keys.req_any())
    for i in range(10):
        streams.enqueue(r, request(f"s{i}"), None)  # one block each
    room = roomy(free_seqs=6, idle=False)
    intake, inbox = start_intake(room)
    got = [next_job(inbox).request_id for _ in range(6)]
    time.sleep(QUIET_S)
    assert got == [f"s{i}" for i in range(6)] and inbox.empty(), "six free slots: six taken in one look"
    room.accounted, room.free_seqs, room.available_blocks = intake.handed, 32, 5  # reserve_blocks 2: 3 to spare
    got = [next_job(inbox).request_id for _ in range(3)]
    time.sleep(QUIET_S)
    assert got == ["s6", "s7", "s8"] and inbox.empty(), "three blocks to spare: three taken"
    assert [streams.parse_request(f).request_id for f in streams.shared_heads(r, count=5)] == ["s9"]


def test_the_shared_streams_requests_are_taken_as_soon_as_room_comes_back(r, start_intake):
    """A worker that took a shared request looks again as soon as its main thread has accounted it, not after its
    own stream's read of up to a heartbeat: before, an idle worker drained a burst that overflowed into the shared
    stream at one request a second (300 short requests at once: the last of the 128 taken answered after 64.6 s)."""
    streams.ensure_group(r, keys.req_any())
    for i in range(6):
        streams.enqueue(r, request(f"s{i}"), None)
    room = roomy(free_seqs=1)  # one at a time: each waits for the main thread to account the one before
    intake, inbox = start_intake(room, heartbeat_s=1.0)
    began = time.monotonic()
    for i in range(6):
        assert next_job(inbox).request_id == f"s{i}"
        room.accounted = intake.handed
    took = time.monotonic() - began
    assert took < 2.5, f"six shared requests, each taken once the one before was accounted, took {took:.1f} s"


def test_a_burst_that_overflowed_into_the_shared_stream_is_taken_once_the_first_requests_are_accounted(
        r, start_intake):
    """A burst reaches an idle worker's own stream and the shared one at once. The reader hands the first requests to
    the main thread, which accounts them only after its next step; meanwhile the reader must not sit in a one-second
    read of its own stream (before: a 512-request burst ran 8 decode steps of 64 sequences, 0.5 s, before the
    worker took the first 32 from the shared stream)."""
    streams.ensure_group(r, keys.req_any())
    room = roomy(free_seqs=32)
    intake, inbox = start_intake(room, heartbeat_s=5.0)
    time.sleep(1.5)  # idle: its looks at the (empty) shared stream are a second apart by now
    pipe = r.pipeline(transaction=False)
    for i in range(4):
        streams.enqueue_commands(pipe, request(f"s{i}"), None, 0)
    streams.enqueue_commands(pipe, request("own-1"), ME, 0)
    pipe.execute()
    assert next_job(inbox).request_id == "own-1"
    time.sleep(0.2)  # the main thread's step with own-1
    room.accounted = intake.handed
    began = time.monotonic()
    got = sorted(next_job(inbox).request_id for _ in range(4))
    took = time.monotonic() - began
    assert got == ["s0", "s1", "s2", "s3"] and took < 0.45, f"the shared stream's requests came {took:.2f} s after"


def test_forwards_a_request_its_whole_cache_cannot_hold_to_a_worker_whose_cache_can(r, start_intake):
    """A request longer than this worker's whole cache goes, in one step, to the live worker of the shard with the
    largest cache that holds it: enqueued there, acked and deleted here; its gateway's relay is told where."""
    streams.ensure_group(r, keys.req_any())
    for worker, total, free in (("w-big", 64, 5), ("w-small", 12, 12)):  # w-small: more free, a cache too small
        streams.publish(r, worker, output_ttl_s=60, status_ttl_s=60, status=WorkerStatus(
            worker_id=worker, model="m", max_model_len=1024, block_size=16, total_blocks=total, free_blocks=free))
    r.xadd(keys.inbox("gw"), {"open": "1"})  # the gateway's inbox (a worker never creates one)
    streams.enqueue(r, request("long", prompt_len=200).model_copy(update={"reply_to": "gw"}), None)  # 13 blocks
    streams.enqueue(r, request("short"), None)
    intake, inbox = start_intake(roomy(total_blocks=8, available_blocks=8))

    short = next_job(inbox)
    assert short.request_id == "short"
    entries = wait_for(lambda: r.xrange(keys.req_stream("w-big")), what="the forward")
    assert [streams.parse_request(f).request_id for _, f in entries] == ["long"]
    forwarded = streams.parse_request(entries[0][1])
    assert (forwarded.attempt, forwarded.kv_blocks, forwarded.reply_to) == (1, 0, "gw")
    left = [streams.parse_request(f).request_id for _, f in r.xrange(keys.req_any())]
    assert left == ["short"]  # the long one's entry acked and deleted here (the short one waits for its ack)
    assert r.xpending(keys.req_any(), keys.GROUP)["pending"] == 1
    moved = [json.loads(f[keys.MOVED_FIELD]) for _, f in r.xrange(keys.inbox("gw")) if keys.MOVED_FIELD in f]
    assert moved == [["long", keys.req_stream("w-big"), entries[0][0]]]
    assert inbox.empty() and intake.settled.get(timeout=1) == "long"


def test_claims_back_what_it_left_pending_before_a_restart(r, start_intake):
    streams.ensure_group(r, keys.req_stream(ME))
    streams.enqueue(r, request("before-restart"), ME)
    deliver_to(r, ME, keys.req_stream(ME))
    _, inbox = start_intake(roomy(spare=False))
    job = next_job(inbox)
    assert (job.request_id, job.deliveries) == ("before-restart", 2)


def test_claims_back_what_it_read_on_another_workers_stream_before_a_restart(r, start_intake):
    """An entry it read on another worker's stream (one it took for dead) is pending on it there: a restart under
    the same id claims it back too."""
    other = "w-other"
    streams.ensure_group(r, keys.req_stream(other))
    streams.enqueue(r, request("read-elsewhere"), other)
    deliver_to(r, ME, keys.req_stream(other))
    r.sadd(keys.workers(), other)
    _, inbox = start_intake(roomy(spare=False))
    job = next_job(inbox)
    assert (job.request_id, job.stream, job.deliveries) == ("read-elsewhere", keys.req_stream(other), 2)


def test_takes_what_a_read_whose_reply_was_lost_delivered_to_it(r, start_intake):
    """Redis answered a read (XREADGROUP) of the worker's, but the reply was lost with the connection (Redis
    stopped just after answering it, a socket timeout): its entries are pending on the worker, which never got
    them, and their readers would wait out their timeout. Here the test makes that read as the worker (in one
    transaction with the enqueue, so the worker's own blocked read does not get there first), then drops the
    connection of the worker's blocked read (CLIENT KILL): its failed turn makes it look, and it takes both
    entries. A gateway's request among them is run here, not handed back (nobody ran it before); the one it took
    earlier is not taken twice. (A heartbeat of 5 s: the worker's read blocks for a second at a time.)"""
    room = roomy(spare=False)
    intake, inbox = start_intake(room, heartbeat_s=5.0)
    streams.enqueue(r, request("taken-before"), ME)
    take_jobs(intake, inbox, room, 1)
    lost = [request("lost-1"), request("lost-2").model_copy(update={"reply_to": keys.inbox("gw-1")})]
    pipe = r.pipeline(transaction=True)
    for req in lost:
        streams.enqueue_commands(pipe, req, ME, 0)
    pipe.xreadgroup(keys.GROUP, ME, {keys.req_stream(ME): ">"}, count=8)
    assert [e for _, e in pipe.execute()[-1][0][1]], "the test's read (the lost reply) got nothing"
    assert inbox.empty()
    for _ in range(5):  # (a read that ended just before the kill meets a new connection: kill the next one)
        blocked = wait_for(lambda: [c["id"] for c in r.client_list() if c["cmd"] == "xreadgroup" and "b" in c["flags"]],
                           what="the worker's blocked read")
        for client_id in blocked:
            r.client_kill_filter(_id=client_id)
        deadline = time.monotonic() + 3
        while inbox.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not inbox.empty():
            break
    jobs = take_jobs(intake, inbox, room, 2)  # (a gateway's request handed back would not come here)
    assert sorted(jobs) == ["lost-1", "lost-2"] and all(j.deliveries == 2 for j in jobs.values()), jobs
    time.sleep(QUIET_S)
    assert inbox.empty(), "an entry it had taken before was taken again"
    assert r.xpending(keys.req_stream(ME), keys.GROUP)["pending"] == 3


def test_a_refusal_reported_twice_claims_the_entry_back_once(r, start_intake):
    """Two flushes can both refuse the same lost delivery before the main thread drops it: the entry is claimed
    back once (a second claim would count as one more delivery, toward max_deliveries)."""
    streams.ensure_group(r, keys.req_stream(ME))
    entry = streams.enqueue(r, request("twice"), ME)
    [delivery] = deliver_to(r, ME, keys.req_stream(ME))
    r.xclaim(keys.req_stream(ME), keys.GROUP, ME, 0, [entry])  # the count moves on (an AOF lost that claim)
    intake, inbox = start_intake(roomy(spare=False), max_deliveries=3)
    job = next_job(inbox)  # the restart's own claim of what it left pending: delivery 3
    assert (job.request_id, job.deliveries) == ("twice", 3)
    intake.recheck(delivery.ack)  # delivery 1 refused, reported by two flushes
    intake.recheck(delivery.ack)
    time.sleep(QUIET_S + 1.0)
    assert inbox.empty() and r.xpending_range(keys.req_stream(ME), keys.GROUP, "-", "+", 1)[0]["times_delivered"] == 3


def test_takes_over_a_dead_workers_pending_requests(r, start_intake):
    """A worker whose status expired left two requests pending on its stream (one half answered) and one
    on the shared stream; a live worker's pending request is not touched."""
    dead, live = "w-dead", "w-live"
    for stream in (keys.req_stream(dead), keys.req_stream(live), keys.req_any()):
        streams.ensure_group(r, stream)
    streams.enqueue(r, request("dead-own-1"), dead)
    streams.enqueue(r, request("dead-own-2"), dead)
    streams.enqueue(r, request("dead-shared"), None)
    streams.enqueue(r, request("live-own"), live)
    deliver_to(r, dead, keys.req_stream(dead), 2)
    deliver_to(r, dead, keys.req_any())
    deliver_to(r, live, keys.req_stream(live))
    streams.publish(r, dead, output_ttl_s=60, chunks=[
        OutputChunk(request_id="dead-own-1", seq=0, token_ids=[11], text="a"),
        OutputChunk(request_id="dead-own-1", seq=1, token_ids=[12, 13], text="bc")])
    r.sadd(keys.workers(), dead)
    alive(r, live)

    time.sleep(1.1)  # past the claim's minimum idle time
    room = roomy()
    intake, inbox = start_intake(room)
    jobs = take_jobs(intake, inbox, room, 3)
    assert {rid: (j.stream, j.deliveries) for rid, j in jobs.items()} == {
        "dead-own-1": (keys.req_stream(dead), 2), "dead-own-2": (keys.req_stream(dead), 2),
        "dead-shared": (keys.req_any(), 2)}
    resumed = jobs["dead-own-1"]
    assert (resumed.sent_tokens, resumed.next_seq) == ([[11, 12, 13]], 2)
    assert not jobs["dead-own-2"].resumed

    mine = r.xpending_range(keys.req_stream(dead), keys.GROUP, "-", "+", 10, consumername=ME)
    assert sorted(p["message_id"] for p in mine) == sorted(j.entry_id for j in jobs.values()
                                                           if j.stream == keys.req_stream(dead))
    assert [p["times_delivered"] for p in mine] == [2, 2]
    assert len(r.xpending_range(keys.req_stream(live), keys.GROUP, "-", "+", 10, consumername=live)) == 1
    time.sleep(QUIET_S)
    assert inbox.empty(), "the live worker's request stays with it"


def test_takes_over_what_a_dead_worker_read_on_live_workers_streams(r, start_intake):
    """A worker that took two others for dead (one had just restarted: this one) read new entries on their
    streams, as itself, and died. Its status expired: those entries are taken over from where they wait, and it
    is forgotten only then (a chaos soak, seed 107, lost such a request: the takeover looked at the dead
    worker's own stream and the shared one only, found them empty, and forgot it)."""
    dying, other = "w-dying", "w-other"
    for stream in (keys.req_stream(ME), keys.req_stream(dying), keys.req_stream(other), keys.req_any()):
        streams.ensure_group(r, stream)
    streams.enqueue(r, request("on-my-stream"), ME)
    streams.enqueue(r, request("on-other-stream"), other)
    deliver_to(r, dying, keys.req_stream(ME))
    deliver_to(r, dying, keys.req_stream(other))
    r.sadd(keys.workers(), ME, dying, other)
    alive(r, other)

    time.sleep(1.1)  # past the claim's minimum idle time
    room = roomy()
    intake, inbox = start_intake(room)
    jobs = take_jobs(intake, inbox, room, 2)
    assert {rid: (j.stream, j.deliveries) for rid, j in jobs.items()} == {
        "on-my-stream": (keys.req_stream(ME), 2), "on-other-stream": (keys.req_stream(other), 2)}
    assert r.sismember(keys.workers(), dying)  # taken over, not yet acked: still known
    for job in jobs.values():
        streams.ack_and_delete(r, streams.Ack(job.stream, job.entry_id))
    wait_for(lambda: not r.sismember(keys.workers(), dying), what="the drained dead worker to be forgotten")
    assert dying not in {c["name"] for c in r.xinfo_consumers(keys.req_stream(other), keys.GROUP)}
    assert r.sismember(keys.workers(), other)


def test_a_request_read_on_a_dead_workers_stream_drops_the_reservation_there(r, start_intake):
    """A router placed a request on a worker this one takes for dead (it may be back already: the list of dead
    workers is up to a heartbeat old, and a blocking read can outlast its return). This worker reads it as its
    own; the router's reservation there goes with it, or it would hold that worker's blocks until the hash
    expires (30 s). Another request's reservation stays."""
    away = "w-away"
    for stream in (keys.req_stream(ME), keys.req_stream(away)):
        streams.ensure_group(r, stream)
    r.sadd(keys.workers(), ME, away)
    streams.enqueue(r, request("routed-there").model_copy(update={"kv_blocks": 2}), away)
    r.hset(keys.reserved(away), "on-its-way", 3)
    assert r.hgetall(keys.reserved(away)) == {"routed-there": "2", "on-its-way": "3"}

    room = roomy()
    intake, inbox = start_intake(room)
    job = next_job(inbox)
    assert (job.request_id, job.stream, job.deliveries) == ("routed-there", keys.req_stream(away), 1)
    wait_for(lambda: r.hgetall(keys.reserved(away)) == {"on-its-way": "3"},
             what="the reservation of the request read there to go")


def test_prunes_a_dead_worker_once_it_is_drained(r, start_intake):
    dead = "w-gone"
    streams.ensure_group(r, keys.req_stream(dead))
    streams.ensure_group(r, keys.req_any())
    streams.enqueue(r, request("left-behind", max_tokens=4).model_copy(update={"kv_blocks": 1}), dead)
    deliver_to(r, dead, keys.req_stream(dead))
    streams.enqueue(r, request("on-shared"), None)
    deliver_to(r, dead, keys.req_any())  # makes it a consumer of the shared stream's group
    r.sadd(keys.workers(), dead)
    time.sleep(1.1)
    room = roomy()
    intake, inbox = start_intake(room)
    taken = [next_job(inbox)]
    room.accounted = intake.handed
    taken.append(next_job(inbox))
    room.accounted = intake.handed
    time.sleep(QUIET_S)  # a few scans: the entry on its own stream is taken but not yet acked
    assert r.sismember(keys.workers(), dead)

    for job in taken:
        streams.ack_and_delete(r, streams.Ack(job.stream, job.entry_id))
    wait_for(lambda: not r.sismember(keys.workers(), dead), what="the drained dead worker to be forgotten")
    assert not r.exists(keys.req_stream(dead), keys.reserved(dead))
    assert dead not in {c["name"] for c in r.xinfo_consumers(keys.req_any(), keys.GROUP)}


def test_dead_letters_a_request_past_max_deliveries(r, start_intake):
    dead, rid = "w-crashy", "poison"
    streams.ensure_group(r, keys.req_stream(dead))
    entry = streams.enqueue(r, request(rid), dead)
    deliver_to(r, dead, keys.req_stream(dead))
    r.sadd(keys.workers(), dead)
    time.sleep(1.1)
    _, inbox = start_intake(roomy(), max_deliveries=1)

    [chunk] = wait_for(lambda: final_chunks(r, rid), what="the dead-letter chunk")
    assert chunk.error.kind == "dead_letter" and "delivered 2 times (max_deliveries 1)" in chunk.error.message
    letters = [DeadLetter.model_validate_json(f[keys.FIELD]) for _, f in r.xrange(keys.DEAD)]
    assert [(d.request.request_id, d.deliveries, d.worker_id) for d in letters] == [(rid, 2, ME)]
    assert r.xrange(keys.req_stream(dead), entry, entry) == []  # acked and deleted with the final chunk
    assert r.xpending(keys.req_stream(dead), keys.GROUP)["pending"] == 0
    assert inbox.empty()


def test_a_cancel_that_beat_the_request_closes_it_without_the_engine(r, start_intake):
    streams.cancel(r, "too-late")
    streams.enqueue(r, request("too-late"), ME)
    streams.enqueue(r, request("runs"), ME)
    intake, inbox = start_intake(roomy())
    [chunk] = wait_for(lambda: final_chunks(r, "too-late"), what="the abort chunk")
    assert (chunk.seq, chunk.finish_reason, chunk.worker_id) == (0, "abort", ME)
    assert next_job(inbox).request_id == "runs"
    assert r.xlen(keys.req_stream(ME)) == 1 and r.xpending(keys.req_stream(ME), keys.GROUP)["pending"] == 1
    time.sleep(QUIET_S)
    assert inbox.empty(), "neither the request nor the cancel written before start reaches the main thread"
    # closed here, its reservation goes with the worker's next status (the one handed over: once it runs)
    assert intake.settled.get_nowait() == "too-late" and intake.settled.empty()


def test_cancels_written_after_start_reach_the_main_thread(r, start_intake):
    _, inbox = start_intake(roomy())
    time.sleep(0.2)
    streams.cancel(r, "a")
    streams.cancel(r, "b")
    assert [inbox.get(timeout=5), inbox.get(timeout=5)] == [Cancel("a"), Cancel("b")]


def test_an_unreadable_cancel_entry_is_skipped_not_read_forever(r, start_intake):
    """An entry of the cancel stream without a request id (a foreign writer's, another version's) used to stop
    every worker's cancel reader on it: each turn failed on that entry, so no cancel and no lease lapse was ever
    seen again. It is skipped; the cancels after it arrive."""
    intake, inbox = start_intake(roomy())
    time.sleep(0.2)
    r.xadd(keys.CANCEL, {"request": "x"})
    streams.cancel(r, "after")
    assert inbox.get(timeout=5) == Cancel("after")
    assert not intake.redis_failing and not intake.dead_threads()


class SlowGrammars:
    """The engine's grammar cache as the intake sees it (`precompile`), with a compile that takes `seconds`."""

    def __init__(self, seconds: float):
        self.seconds, self.compiled = seconds, []

    def compile(self, spec: dict) -> None:
        time.sleep(self.seconds)
        self.compiled.append(spec)


def test_a_long_grammar_compile_does_not_delay_taking_over_a_dead_worker(r):
    """A turn of the reader that took a status TTL means Redis hung, and dead workers are taken over only a TTL
    later (a missing status proves nothing yet). A grammar compile that long is not Redis hanging: a worker
    whose status expired meanwhile is taken over at the next scan."""
    ttl_s, compile_s, dying = 2.0, 3.0, "w-dying"
    for stream in (keys.req_stream(ME), keys.req_stream(dying), keys.req_any()):
        streams.ensure_group(r, stream)
    streams.enqueue(r, request("left-behind"), dying)
    deliver_to(r, dying, keys.req_stream(dying))
    r.sadd(keys.workers(), dying)
    streams.publish(r, dying, output_ttl_s=60, status_ttl_s=ttl_s, status=WorkerStatus(  # expires mid-compile
        worker_id=dying, model="m", max_model_len=1024, block_size=16, total_blocks=64, free_blocks=64))
    schema = request("structured").model_copy(update={"sampling_params": SamplingParams(
        max_tokens=4, structured_outputs={"choice": ["yes", "no"]}).to_dict()})
    streams.enqueue(r, schema, ME)
    room, inbox, grammars = roomy(), queue.Queue(), SlowGrammars(compile_s)
    intake = Intake(r, Settings(worker_id=ME, heartbeat_s=0.2, status_ttl_s=ttl_s), ME, inbox, lambda: room,
                    precompile=grammars).start()
    try:
        first = next_job(inbox, timeout_s=compile_s + 5)
        compiled_at = time.monotonic()
        assert first.request_id == "structured" and grammars.compiled == [{"choice": ["yes", "no"]}]
        assert not r.exists(keys.status(dying)), "the dying worker's status expired during the compile"
        room.accounted = intake.handed
        taken = next_job(inbox, timeout_s=compile_s + 5)
        assert (taken.request_id, taken.stream, taken.deliveries) == ("left-behind", keys.req_stream(dying), 2)
        waited = time.monotonic() - compiled_at
        assert waited < ttl_s / 2, f"taken over {waited:.2f}s after the compile: held back as if Redis had hung"
    finally:
        intake.stop()
        time.sleep(1.1)  # the cancel reader blocks up to 1 s
