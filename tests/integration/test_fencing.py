"""Ownership of a request-stream entry against a real Redis, no worker processes: the flush script writes a
request's chunks, hand-back and ack only under the delivery that still owns the entry (consumer and delivery
count of its pending record); a takeover claims every pending entry, page by page; a dead worker is forgotten
only in one step with the checks that it left nothing behind; readers drop chunks of an older owner."""

from __future__ import annotations

import pytest

from shared import keys, streams
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

OLD, NEW = "w-old", "w-new"


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                             sampling_params=SamplingParams(max_tokens=4).to_dict())


def taken_by_old(r, rid: str) -> streams.Delivery:
    stream = keys.req_stream(OLD)
    streams.ensure_group(r, stream)
    streams.enqueue(r, request(rid), OLD)
    [delivery] = streams.read_requests(r, OLD, {stream: ">"}, count=1)
    return delivery


def chunk(rid: str, seq: int, worker: str, delivery: int, **kw) -> OutputChunk:
    return OutputChunk(request_id=rid, seq=seq, token_ids=[seq], text=f"t{seq}", worker_id=worker,
                       delivery=delivery, **kw)


def test_a_worker_that_lost_the_entry_can_neither_write_nor_ack_nor_hand_back(r):
    old = taken_by_old(r, "req")
    assert old.deliveries == 1
    out = streams.publish(r, OLD, output_ttl_s=60, chunks=[chunk("req", 0, OLD, 1)], owners={"req": old.ack})
    assert out == []
    [new] = streams.claim_pending(r, old.stream, OLD, NEW, min_idle_ms=0)
    assert (new.entry_id, new.deliveries) == (old.entry_id, 2)

    refused = streams.publish(r, OLD, output_ttl_s=60, chunks=[chunk("req", 1, OLD, 1, final=True)],
                              acks=[old.ack], owners={"req": old.ack}, requeued=[(request("req"), old.ack)])
    assert refused == [old.ack]
    assert [c.worker_id for c in streams.read_all_chunks(r, "req")] == [OLD]
    assert r.xlen(keys.req_any()) == 0, "no hand-back from a worker that lost the request"
    [pending] = r.xpending_range(old.stream, keys.GROUP, "-", "+", 10)
    assert (pending["consumer"], pending["times_delivered"]) == (NEW, 2)

    assert streams.publish(r, NEW, output_ttl_s=60, chunks=[chunk("req", 1, NEW, 2, final=True)], acks=[new.ack],
                           owners={"req": new.ack}) == []
    assert [(c.seq, c.worker_id) for c in streams.read_all_chunks(r, "req")] == [(0, OLD), (1, NEW)]
    assert r.xpending(old.stream, keys.GROUP)["pending"] == 0 and r.xlen(old.stream) == 0


def test_a_hand_back_sent_twice_is_made_once(r):
    """A flush whose reply was lost (the connection dropped after Redis ran it) is sent again by redis-py: its
    hand-back must not put the request on the shared stream twice (two workers would run it)."""
    old = taken_by_old(r, "handed")
    run = "run-1"
    streams.publish(r, OLD, output_ttl_s=60, status=status_of(OLD, run), status_ttl_s=5, run_id=run)
    for _ in range(2):  # the flush, and the same flush again
        assert streams.publish(r, OLD, output_ttl_s=60, run_id=run, owners={"handed": old.ack},
                               requeued=[(request("handed"), old.ack)]) == []
    assert [streams.parse_request(f).request_id for _, f in r.xrange(keys.req_any())] == ["handed"]
    assert r.xpending(old.stream, keys.GROUP)["pending"] == 0 and r.xlen(old.stream) == 0


def test_a_refused_request_does_not_hold_back_the_rest_of_the_flush(r):
    lost, kept = taken_by_old(r, "lost"), taken_by_old(r, "kept")
    streams.claim_pending(r, lost.stream, OLD, NEW, min_idle_ms=0)  # takes both
    [kept_again] = [d for d in streams.claim_pending(r, kept.stream, NEW, OLD, min_idle_ms=0)
                    if d.entry_id == kept.entry_id] or [None]
    assert kept_again is not None and kept_again.deliveries == 3
    status = WorkerStatus(worker_id=OLD, model="m", max_model_len=64, block_size=16, total_blocks=8, free_blocks=8)
    refused = streams.publish(r, OLD, output_ttl_s=60, status=status, status_ttl_s=5,
                              chunks=[chunk("lost", 0, OLD, 1), chunk("kept", 0, OLD, 3, final=True)],
                              acks=[lost.ack, kept_again.ack], owners={"lost": lost.ack, "kept": kept_again.ack})
    assert refused == [lost.ack]
    assert streams.read_all_chunks(r, "lost") == [] and len(streams.read_all_chunks(r, "kept")) == 1
    assert r.get(keys.status(OLD)) is not None and r.sismember(keys.workers(), OLD)
    assert r.xrange(kept.stream, kept.entry_id, kept.entry_id) == []  # acked and deleted


def test_a_takeover_claims_every_pending_entry_page_by_page(r):
    stream, n = keys.req_stream(OLD), 2 * streams.worker.CLAIM_PAGE + 17
    streams.ensure_group(r, stream)
    for i in range(n):
        streams.enqueue(r, request(f"r{i}"), OLD)
    assert len(streams.read_requests(r, OLD, {stream: ">"}, count=n)) == n
    claimed = streams.claim_pending(r, stream, OLD, NEW, min_idle_ms=0)
    assert len({d.entry_id for d in claimed}) == n and {d.deliveries for d in claimed} == {2}
    assert r.xpending_range(stream, keys.GROUP, "-", "+", 1, consumername=OLD) == []


def test_a_takeover_scan_names_who_holds_entries_on_each_stream(r):
    """One XPENDING summary a stream: the consumers with entries pending there (not those whose entries were
    all acked, nor a stream that does not exist yet), so the scan need not ask once per dead worker."""
    mine, gone = keys.req_stream(OLD), keys.req_stream("w-never-started")
    streams.ensure_group(r, mine)
    streams.ensure_group(r, keys.req_any())
    for rid in ("a", "b"):
        streams.enqueue(r, request(rid), OLD)
    streams.enqueue(r, request("c"), None)
    [a] = streams.read_requests(r, OLD, {mine: ">"}, count=1)
    streams.read_requests(r, NEW, {mine: ">"}, count=1)
    [c] = streams.read_requests(r, NEW, {keys.req_any(): ">"}, count=1)
    streams.ack_and_delete(r, c.ack)
    assert streams.pending_owners(r, [mine, keys.req_any(), gone]) == {mine: {OLD, NEW}, keys.req_any(): set()}
    streams.ack_and_delete(r, a.ack)
    assert streams.pending_owners(r, [mine]) == {mine: {NEW}}


def test_a_dead_worker_is_forgotten_only_when_it_left_nothing_and_stays_dead(r):
    dead = "w-dead"
    streams.ensure_group(r, keys.req_any())
    r.sadd(keys.workers(), dead)
    r.set(keys.status(dead), "{}")  # it came back meanwhile
    assert not streams.prune_dead_worker(r, dead)
    r.delete(keys.status(dead))
    streams.enqueue(r, request("queued"), dead)  # a gateway's XADD just before the prune
    assert not streams.prune_dead_worker(r, dead)
    assert r.xlen(keys.req_stream(dead)) == 1 and r.sismember(keys.workers(), dead)
    r.delete(keys.req_stream(dead))
    streams.enqueue(r, request("shared"), None)
    streams.read_requests(r, dead, {keys.req_any(): ">"}, count=1)  # pending on it in the shared stream
    assert not streams.prune_dead_worker(r, dead)
    streams.claim_pending(r, keys.req_any(), dead, NEW, min_idle_ms=0)
    r.hset(keys.reserved(dead), "x", 1)
    assert streams.prune_dead_worker(r, dead)
    assert not r.sismember(keys.workers(), dead) and not r.exists(keys.reserved(dead))
    assert dead not in {c["name"] for c in r.xinfo_consumers(keys.req_any(), keys.GROUP)}


def test_readers_drop_chunks_from_an_older_owner():
    dedup = streams.ChunkDeduper()
    assert dedup.accept(chunk("x", 0, OLD, 1))
    assert dedup.accept(chunk("x", 1, NEW, 2))
    assert not dedup.accept(chunk("x", 2, OLD, 1)), "the old owner's write after the takeover"
    assert dedup.accept(chunk("x", 2, NEW, 2))
    handed_back = chunk("x", 3, "w-third", 1).model_copy(update={"attempt": 1})
    assert dedup.accept(handed_back), "a re-enqueued request starts its delivery count again"


def test_a_reader_relays_nothing_an_older_owner_wrote_after_a_newer_one(r):
    """What the gateway's relay (streams.aiter_output) and the client read: a stale writer's chunk that slipped
    into the stream (an unfenced writer) is skipped, and the new owner's chunk with that number is relayed."""
    written = [chunk("s", 0, OLD, 1), chunk("s", 1, NEW, 2), chunk("s", 2, OLD, 1),
               chunk("s", 2, NEW, 2, final=True)]
    streams.publish(r, NEW, output_ttl_s=60, chunks=written)
    got = list(streams.iter_output(r, "s", timeout_s=5))
    assert [(c.seq, c.worker_id) for c in got] == [(0, OLD), (1, NEW), (2, NEW)]


def test_an_entry_still_pending_on_the_refused_worker_is_claimed_back_by_it(r):
    """Redis came back from an AOF that lost a claim: the entry is pending on this worker, with a delivery
    count other than its token. Its writes are refused, then it claims the entry again under a new token."""
    old = taken_by_old(r, "again")
    r.xclaim(old.stream, keys.GROUP, OLD, 0, [old.entry_id])  # the count moves on without the worker knowing
    assert streams.publish(r, OLD, output_ttl_s=60, chunks=[chunk("again", 0, OLD, 1)],
                           owners={"again": old.ack}) == [old.ack]
    again = streams.reclaim_own(r, old.ack, OLD)
    assert again is not None and again.deliveries == 3 and streams.parse_request(again.fields).request_id == "again"
    assert streams.publish(r, OLD, output_ttl_s=60, chunks=[chunk("again", 0, OLD, 3, final=True)],
                           acks=[again.ack], owners={"again": again.ack}) == []
    assert r.xlen(old.stream) == 0
    assert streams.reclaim_own(r, again.ack, OLD) is None, "gone: nothing to claim"


def status_of(worker: str, run_id: str) -> WorkerStatus:
    return WorkerStatus(worker_id=worker, model="m", max_model_len=64, block_size=16, total_blocks=8,
                        free_blocks=8, run_id=run_id)


def test_the_fenced_flush_acks_a_streams_entries_together_and_carries_the_status(r):
    """With the fence up (the status in Redis is this run's), a flush is _FLUSH_FENCED: every finished entry of
    one stream acked and deleted (one XACK and one XDEL for all of them), the status refreshed in the same
    script, the reservations its status covers released."""
    run = "run-a"
    streams.publish(r, OLD, output_ttl_s=60, status=status_of(OLD, run), status_ttl_s=5, run_id=run)
    taken = [taken_by_old(r, f"f{i}") for i in range(5)]
    r.hset(keys.reserved(OLD), mapping={"f0": 1, "f1": 1})
    calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
    refused = streams.publish(r, OLD, output_ttl_s=60, run_id=run, status=status_of(OLD, run), status_ttl_s=5,
                              chunks=[chunk(d.ack.entry_id, 0, OLD, 1, final=True) for d in taken],
                              acks=[d.ack for d in taken], owners={d.ack.entry_id: d.ack for d in taken},
                              taken=["f0", "f1"])
    after = {k: v["calls"] for k, v in r.info("commandstats").items()}
    assert refused == []
    assert r.xlen(keys.req_stream(OLD)) == 0 and r.xpending(keys.req_stream(OLD), keys.GROUP)["pending"] == 0
    assert not r.exists(keys.reserved(OLD))
    assert run in r.get(keys.status(OLD)) and 0 < r.pttl(keys.status(OLD)) <= 5000
    delta = {k: after[k] - calls.get(k, 0) for k in after if after[k] != calls.get(k, 0)}
    assert delta.get("cmdstat_xack") == 1 and delta.get("cmdstat_xdel") == 1, delta
    assert delta.get("cmdstat_set") == 1 and "cmdstat_get" not in delta, "the status's SET ... GET is the fence"


@pytest.mark.parametrize("replaced", [False, True])
def test_a_flush_with_its_status_after_a_takeover_writes_nothing_under_the_lost_entry(r, replaced):
    """The fence went down: another worker claimed the entry (and deleted this run's status), or another run of
    the same worker id wrote its own status. The fenced script's SET ... GET sees it, puts back what was there
    and gives way to _FLUSH, which must judge the status as it was (not the one just written): the lost
    entry's chunk and ack are refused, while the status of this run goes out."""
    run = "run-a"
    streams.publish(r, OLD, output_ttl_s=60, status=status_of(OLD, run), status_ttl_s=5, run_id=run)
    old = taken_by_old(r, "gone")
    streams.claim_pending(r, old.stream, OLD, NEW, min_idle_ms=0)
    assert not r.exists(keys.status(OLD)), "the claim deleted the status: the fence is down"
    if replaced:
        r.set(keys.status(OLD), status_of(OLD, "run-b").model_dump_json(), px=5000)
    refused = streams.publish(r, OLD, output_ttl_s=60, run_id=run, status=status_of(OLD, run), status_ttl_s=5,
                              chunks=[chunk("gone", 0, OLD, 1, final=True)], acks=[old.ack],
                              owners={"gone": old.ack}, held=[old.ack])
    assert refused == [old.ack]
    assert streams.read_all_chunks(r, "gone") == []
    [pending] = r.xpending_range(old.stream, keys.GROUP, "-", "+", 10)
    assert pending["consumer"] == NEW, "not acked by the worker that lost it"
    assert run in r.get(keys.status(OLD)), "this run's status went out with _FLUSH (it re-arms the fence)"
