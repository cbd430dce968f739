"""Takeover and fencing with real worker processes and real faults, requests written straight into the
streams (no gateway): a worker restarted under its id answers everything it left pending; a busy worker takes
over a killed one's requests within the status TTL plus a few seconds; a worker paused past the status TTL
cannot write again for a request another took over (it aborts it), and the reader sees each token once; a
draining worker hands back what it has not started at once."""

from __future__ import annotations

import signal
import time

import pytest
from fleet_harness import Fleet

from shared import keys, streams
from shared.messages import GenerationRequest, OutputChunk
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

STATUS_TTL_S = 2.0
ENV = {"KVFLEET_STATUS_TTL_S": str(STATUS_TTL_S), "KVFLEET_HEARTBEAT_S": "0.5"}


@pytest.fixture
def fleet(tiny_llama_dir, tmp_path):
    with Fleet(tiny_llama_dir, tmp_path, env=ENV) as f:
        yield f


def request(rid: str, i: int, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=[5 + i % 50, 17, 30 + i % 20, 9],
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True).to_dict())


def put(r, worker: str, rid: str, i: int, max_tokens: int) -> str:
    streams.ensure_group(r, keys.req_stream(worker))
    return streams.enqueue(r, request(rid, i, max_tokens), worker)


def start(fleet: Fleet, r, worker: str, *flags: str) -> None:
    fleet.start_worker(worker, "--num-kv-blocks", "256", *flags)
    fleet.wait_for(lambda: r.exists(keys.status(worker)), timeout_s=120, what=f"{worker} to start")


def answer(r, rid: str) -> list[OutputChunk]:
    """Every chunk of the request as a client reads it (each once), up to its final one."""
    return list(streams.iter_output(r, rid, timeout_s=90))


def tokens(chunks: list[OutputChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def assert_written_once(r, rid: str, max_tokens: int) -> list[OutputChunk]:
    """The output stream as written (not deduplicated): each sequence number once, one final chunk, all the
    tokens, no error."""
    raw = streams.read_all_chunks(r, rid)
    assert [c.seq for c in raw] == list(range(len(raw))), f"{rid}: {[(c.seq, c.worker_id) for c in raw]}"
    assert [c.final for c in raw].count(True) == 1 and raw[-1].final and raw[-1].error is None, raw[-1]
    assert len(tokens(raw)) == max_tokens
    return raw


def pending_on(r, worker: str, stream: str) -> int:
    try:
        return len(r.xpending_range(stream, keys.GROUP, "-", "+", 1000, consumername=worker))
    except streams.RedisError:
        return 0


def test_a_worker_restarted_under_its_id_answers_all_it_left_pending(fleet):
    r = streams.connect(fleet.redis.url)
    stream, n = keys.req_stream("w0"), 50
    rids = [f"left-{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        put(r, "w0", rid, i, 4)
    assert len(streams.read_requests(r, "w0", {stream: ">"}, count=n)) == n  # a run of w0 that then died
    start(fleet, r, "w0", "--max-num-seqs", "8")
    for rid in rids:
        assert len(tokens(answer(r, rid))) == 4
        assert_written_once(r, rid, 4)
    fleet.wait_for(lambda: r.xpending(stream, keys.GROUP)["pending"] == 0, what="every entry acked")
    assert "claimed 50 request(s) left pending by w0" in fleet.logs["w0"].read_text()


def test_a_busy_worker_takes_over_a_killed_ones_requests(fleet):
    """Both workers hold more than they can run (max_num_seqs 2); w1 is killed mid-generation; w0 claims its
    requests although it has no room to spare, within the status TTL plus a few seconds."""
    r = streams.connect(fleet.redis.url)
    start(fleet, r, "w0", "--max-num-seqs", "2")
    start(fleet, r, "w1", "--max-num-seqs", "2")
    max_tokens, per_worker = 160, 5
    rids = {w: [f"{w}-req-{i}" for i in range(per_worker)] for w in ("w0", "w1")}
    for w, ids in rids.items():
        for i, rid in enumerate(ids):
            put(r, w, rid, i, max_tokens)
    fleet.wait_for(lambda: any(streams.read_all_chunks(r, rid) for rid in rids["w1"]), what="w1 to generate")
    w0_status = fleet.wait_for(lambda: streams.other_workers(r, "w1").get("w0"), what="w0's status")
    assert w0_status.waiting + w0_status.running > 0, "w0 is busy when w1 dies"
    left = pending_on(r, "w1", keys.req_stream("w1"))
    assert left > 0, "w1 dies holding requests"
    fleet.signal_worker("w1", signal.SIGKILL)
    killed = time.monotonic()
    fleet.wait_for(lambda: pending_on(r, "w1", keys.req_stream("w1")) == 0, timeout_s=STATUS_TTL_S + 8,
                   what="w0 to take over w1's requests")
    print(f"\nw0 took over {left} request(s) {time.monotonic() - killed:.1f}s after w1 was killed")
    for rid in rids["w0"] + rids["w1"]:
        got = answer(r, rid)
        raw = assert_written_once(r, rid, max_tokens)
        assert tokens(got) == tokens(raw)


def test_a_worker_paused_past_its_ttl_cannot_write_a_request_taken_over(fleet):
    """SIGSTOP w1 mid-generation past the status TTL: w0 claims the request and continues it; after SIGCONT
    w1's writes for it are refused and it aborts it (and stays up). The reader gets each token once, from
    one owner at a time, and the text of an undisturbed greedy run."""
    r = streams.connect(fleet.redis.url)
    start(fleet, r, "w0")
    start(fleet, r, "w1")
    max_tokens = 400
    put(r, "w1", "reference", 3, max_tokens)
    reference = tokens(answer(r, "reference"))
    assert len(reference) == max_tokens

    put(r, "w1", "paused", 3, max_tokens)
    fleet.wait_for(lambda: len(streams.read_all_chunks(r, "paused")) >= 5, what="w1 to generate")
    fleet.signal_worker("w1", signal.SIGSTOP)
    try:
        fleet.wait_for(lambda: pending_on(r, "w0", keys.req_stream("w1")) == 1, timeout_s=STATUS_TTL_S + 8,
                       what="w0 to take over the paused worker's request")
        fleet.wait_for(lambda: any(c.worker_id == "w0" for c in streams.read_all_chunks(r, "paused")),
                       what="w0 to write")
    finally:
        fleet.signal_worker("w1", signal.SIGCONT)
    got = answer(r, "paused")
    assert tokens(got) == reference
    raw = assert_written_once(r, "paused", max_tokens)
    writers = [c.worker_id for c in raw]
    first_w0 = writers.index("w0")
    assert set(writers[:first_w0]) == {"w1"} and set(writers[first_w0:]) == {"w0"}, writers
    assert {c.delivery for c in raw[first_w0:]} == {2}
    fleet.wait_for(lambda: "was taken over by another worker: aborted here" in fleet.logs["w1"].read_text(),
                   what="w1 to abort the request it lost")
    assert fleet.workers["w1"].poll() is None, "w1 survives losing the request"
    fleet.wait_for(lambda: (s := streams.other_workers(r, "w0").get("w1")) and s.running == 0,
                   what="w1 to free the request's blocks")
    put(r, "w1", "after", 4, 8)
    assert len(tokens(answer(r, "after"))) == 8


def test_a_draining_worker_hands_back_what_it_has_not_started_at_once(fleet):
    r = streams.connect(fleet.redis.url)
    start(fleet, r, "w0", "--max-num-seqs", "1", "--drain-timeout", "60")
    rids = [f"drain-{i}" for i in range(4)]
    # all four in one MULTI: w0's blocking read wakes once and takes them together (its backlog is
    # max_num_seqs, 1: one at a time could leave some in the stream, never waiting in its scheduler)
    streams.ensure_group(r, keys.req_stream("w0"))
    pipe = r.pipeline(transaction=True)
    for i, rid in enumerate(rids):
        # the started one long enough (near the tiny model's 1,024 positions) to be running still when the
        # test looks, however fast this CPU
        streams.enqueue_commands(pipe, request(rid, i, 1000 if i == 0 else 300), "w0", 0)
    pipe.execute()
    fleet.wait_for(lambda: streams.read_all_chunks(r, rids[0]), what="the first request to start")
    fleet.wait_for(lambda: (s := streams.other_workers(r, "w1").get("w0")) and s.waiting == 3,
                   what="the other three to wait")
    fleet.signal_worker("w0", signal.SIGTERM)
    fleet.wait_for(lambda: r.xlen(keys.req_any()) == 3, timeout_s=10, what="the waiting requests handed back")
    handed = {streams.parse_request(f).request_id for _, f in r.xrange(keys.req_any())}
    assert handed == set(rids[1:])
    assert fleet.workers["w0"].poll() is None, "w0 still finishes the one it started"
    assert r.xpending(keys.req_stream("w0"), keys.GROUP)["pending"] == 1
    assert fleet.workers["w0"].wait(60) == 0
    assert_written_once(r, rids[0], 1000)


def test_a_worker_whose_token_went_stale_claims_its_request_back_and_finishes_it(fleet):
    """The entry's delivery count moves on while the worker runs it, and its status is gone (as when Redis comes
    back from an AOF that lost the worker's last claim, after its status expired): its writes are refused, it aborts the request, finds the entry still
    pending on itself, claims it again and resumes it; the text equals an undisturbed run."""
    r = streams.connect(fleet.redis.url)
    start(fleet, r, "w0")
    max_tokens = 300
    put(r, "w0", "reference", 7, max_tokens)
    reference = tokens(answer(r, "reference"))
    entry = put(r, "w0", "stale", 7, max_tokens)
    fleet.wait_for(lambda: len(streams.read_all_chunks(r, "stale")) >= 5, what="w0 to generate")
    r.xclaim(keys.req_stream("w0"), keys.GROUP, "w0", 0, [entry])
    r.delete(keys.status("w0"))  # that AOF had the status expire too: the worker's next flush checks what it holds
    assert tokens(answer(r, "stale")) == reference
    raw = assert_written_once(r, "stale", max_tokens)
    assert {c.delivery for c in raw} == {1, 3}
    assert "still pending here: claimed again" in fleet.logs["w0"].read_text()
