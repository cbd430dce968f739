"""A gateway's output inbox against a real Redis, no worker processes: a worker flush writes one inbox entry per
gateway with all its chunks for that gateway's requests; the gateway's one reader hands each chunk to its
request's mailbox, once and in order; a gap, a vanished lease, a `worker_lost` chunk, a dead Redis and
silence each end a relay the way it expects; an inbox nobody keeps is never created by a worker. And the
fence that lets a flush skip the per-request ownership check while the worker's status is its run's."""

from __future__ import annotations

import asyncio

import pytest

from gateway.inbox import Inbox, WorkerLost
from shared import keys, streams
from shared.messages import ChunkError, GenerationRequest, OutputChunk, WorkerStatus

pytestmark = pytest.mark.integration

W = "w-inbox"


def chunk(rid: str, seq: int, **kw) -> OutputChunk:
    return OutputChunk(request_id=rid, seq=seq, token_ids=[seq], text=f"t{seq}", worker_id=W, delivery=1, **kw)


def status(run_id: str) -> WorkerStatus:
    return WorkerStatus(worker_id=W, model="m", max_model_len=64, block_size=16, total_blocks=8, free_blocks=8,
                        run_id=run_id)


def taken(r, rid: str, reply_to: str | None = None) -> streams.Delivery:
    stream = keys.req_stream(W)
    streams.ensure_group(r, stream)
    streams.enqueue(r, GenerationRequest(request_id=rid, prompt_token_ids=[1, 2], reply_to=reply_to), W)
    [d] = streams.read_requests(r, W, {stream: ">"}, count=1)
    return d


@pytest.fixture
def quick_silence_check(monkeypatch):
    """A relay checks its request entry after 0.3 s without a chunk (10 s in service)."""
    import gateway.inbox as inbox_module

    monkeypatch.setattr(inbox_module, "SILENCE_CHECK_S", 0.3)
    monkeypatch.setattr(inbox_module, "TICK_S", 0.1)


def run(coro):
    return asyncio.run(coro)


async def collect(inbox: Inbox, rid: str, **kw) -> list[OutputChunk]:
    return [c async for c in inbox.chunks(rid, timeout_s=kw.pop("timeout_s", 5), grace_s=kw.pop("grace_s", 5), **kw)]


def test_one_flush_writes_one_entry_per_gateway_and_each_relay_gets_its_own_chunks(r, redis_url):
    async def main():
        ar = streams.connect_async(redis_url)
        a, b = Inbox(ar, "gw-a", ttl_s=60, block_ms=100), Inbox(ar, "gw-b", ttl_s=60, block_ms=100)
        await a.start()
        await b.start()
        for rid in ("x", "y"):
            a.open(rid)
        b.open("z")
        reply_to = {"x": a.gateway_id, "y": a.gateway_id, "z": b.gateway_id}
        flushes = [[chunk("x", 0), chunk("y", 0), chunk("z", 0)],
                   [chunk("x", 1), chunk("y", 1, final=True), chunk("z", 1, final=True)],
                   [chunk("x", 2, final=True), chunk("stray", 0)]]
        for flush in flushes:
            streams.publish(r, W, output_ttl_s=60, chunks=flush, reply_to=reply_to | {"stray": a.gateway_id})
        got = await asyncio.gather(collect(a, "x"), collect(a, "y"), collect(b, "z"))
        # every token once and in order; the chunks that piled up come merged (gateway.inbox.gather)
        assert [[t for c in g for t in c.token_ids] for g in got] == [[0, 1, 2], [0, 1], [0, 1]]
        assert [g[-1].seq for g in got] == [2, 1, 1] and all(g[-1].final for g in got)
        assert r.xlen(keys.inbox(a.gateway_id)) == 1 + 3 and r.xlen(keys.inbox(b.gateway_id)) == 1 + 2, "one entry per flush per gateway (+ its opening)"
        assert not any(r.exists(keys.out_stream(rid)) for rid in "xyz"), "no stream of their own"
        await asyncio.sleep(0.3)
        assert a.dropped == 1, "the chunk of a request with no mailbox is dropped"
        await a.close()
        await b.close()
        await ar.aclose()

    run(main())


def test_a_worker_never_creates_an_inbox_nobody_keeps(r):
    assert streams.publish(r, W, output_ttl_s=60, chunks=[chunk("gone", 0)], reply_to={"gone": "dead"}) == []
    assert not r.exists(keys.inbox("dead"))


def test_a_relay_ends_as_its_request_does(r, redis_url):
    async def main():
        ar = streams.connect_async(redis_url)
        inbox = Inbox(ar, "gw", ttl_s=60, block_ms=100)
        await inbox.start()
        for rid in ("gap", "lost", "moved", "after", "quiet"):
            inbox.open(rid)
        write = [chunk("gap", 0), chunk("gap", 2), chunk("moved", 0),
                 chunk("moved", 1, final=True, error=ChunkError(kind="worker_lost", message="w died")),
                 chunk("after", 3), chunk("after", 4, final=True)]
        streams.publish(r, W, output_ttl_s=60, chunks=write, reply_to={c.request_id: inbox.gateway_id for c in write})
        with pytest.raises(streams.OutputLost, match="lost chunks 1..1"):
            await collect(inbox, "gap")
        with pytest.raises(streams.OutputLost, match="lease vanished"):
            await collect(inbox, "lost", lost=lambda: True)
        with pytest.raises(WorkerLost, match="w died"):
            await collect(inbox, "moved")
        after = await collect(inbox, "after", after_seq=2)
        assert [t for c in after for t in c.token_ids] == [3, 4] and after[-1].seq == 4, "placed again after chunk 2"
        with pytest.raises(streams.OutputTimeout):
            await collect(inbox, "quiet", timeout_s=0.3)
        await inbox.close()
        await ar.aclose()

    run(main())


def test_a_relay_whose_request_ended_as_its_lease_was_found_gone_gets_its_last_chunks(r, redis_url,
                                                                                   quick_silence_check):
    """The lease refresh finds a lease gone with its request's entry (acked): Redis lost the request, or it just
    ended, its lease having lapsed while Redis refused writes, its final chunk written with the ack and still on its
    way to the relay. The relay waits a tick for it: a request that ended is relayed to its end, not placed again
    (which ran it a second time)."""
    async def main():
        ar = streams.connect_async(redis_url)
        inbox = Inbox(ar, "gw", ttl_s=60, block_ms=100)
        await inbox.start()
        inbox.open("ended")
        streams.publish(r, W, output_ttl_s=60, chunks=[chunk("ended", 0)], reply_to={"ended": inbox.gateway_id})
        relay = asyncio.create_task(collect(inbox, "ended", lost=lambda: True))
        await asyncio.sleep(0.05)  # the relay took chunk 0 and finds its lease gone
        streams.publish(r, W, output_ttl_s=60, chunks=[chunk("ended", 1, final=True)],
                        reply_to={"ended": inbox.gateway_id})
        got = await relay
        await inbox.close()
        await ar.aclose()
        return got

    assert [c.seq for c in run(main())] == [0, 1]


def test_a_relay_waits_out_a_short_outage_and_fails_past_the_grace(redis_url):
    async def main():
        ar = streams.connect_async("redis://127.0.0.1:1/0")  # nothing listens there
        inbox = Inbox(ar, "gw", ttl_s=60, block_ms=100)
        await inbox.start()
        inbox.open("x")
        with pytest.raises(streams.RedisAway):
            await collect(inbox, "x", grace_s=0.5, timeout_s=30)
        await inbox.close()

    run(main())


def test_the_reader_creates_the_inbox_again_when_redis_lost_it(r, redis_url):
    async def main():
        ar = streams.connect_async(redis_url)
        inbox = Inbox(ar, "gw", ttl_s=60, block_ms=100)
        await inbox.start()
        r.flushall()
        for _ in range(40):
            await asyncio.sleep(0.1)
            if r.exists(keys.inbox(inbox.gateway_id)):
                break
        assert r.exists(keys.inbox(inbox.gateway_id)) and 0 < r.pttl(keys.inbox(inbox.gateway_id)) <= 60_000
        inbox.open("x")
        streams.publish(r, W, output_ttl_s=60, chunks=[chunk("x", 0, final=True)], reply_to={"x": inbox.gateway_id})
        assert [c.seq for c in await collect(inbox, "x")] == [0]
        await inbox.close()
        assert not r.exists(keys.inbox(inbox.gateway_id)), "a gateway that stops deletes its inbox"
        await ar.aclose()

    run(main())


def test_while_the_status_is_its_runs_a_flush_checks_no_chunk_owner(r):
    d = taken(r, "run")
    before = r.info("commandstats").get("cmdstat_xpending", {}).get("calls", 0)
    for seq in range(5):
        assert streams.publish(r, W, output_ttl_s=60, chunks=[chunk("run", seq)], owners={"run": d.ack},
                               status=status("run-1"), status_ttl_s=5, run_id="run-1", held=[d.ack]) == []
    checks = r.info("commandstats")["cmdstat_xpending"]["calls"] - before
    assert checks == 1, "only the first flush (no status of this run yet) checks"
    assert streams.publish(r, W, output_ttl_s=60, chunks=[chunk("run", 5, final=True)], acks=[d.ack],
                           owners={"run": d.ack}, run_id="run-1") == []
    assert r.info("commandstats")["cmdstat_xpending"]["calls"] - before == 1, "nor its ack"
    assert r.xlen(d.stream) == 0


def test_after_a_takeover_the_next_status_flush_finds_every_request_lost_even_without_a_chunk(r):
    idle, busy = taken(r, "idle"), taken(r, "busy")
    streams.publish(r, W, output_ttl_s=60, status=status("run-1"), status_ttl_s=5, run_id="run-1",
                    held=[idle.ack, busy.ack])
    r.delete(keys.status(W))  # it expired (the worker was paused)
    streams.claim_pending(r, idle.stream, W, "w-other", min_idle_ms=0)  # takes both, deletes the status again
    refused = streams.publish(r, W, output_ttl_s=60, chunks=[chunk("busy", 0)], owners={"busy": busy.ack},
                              status=status("run-1"), status_ttl_s=5, run_id="run-1", held=[idle.ack, busy.ack])
    assert set(refused) == {idle.ack, busy.ack}
    assert streams.read_all_chunks(r, "busy") == []


def test_a_later_run_under_the_same_id_fences_the_earlier_one(r):
    d = taken(r, "old-run")
    streams.publish(r, W, output_ttl_s=60, status=status("run-1"), status_ttl_s=5, run_id="run-1", held=[d.ack])
    streams.claim_pending(r, d.stream, W, W, min_idle_ms=0)  # the new run claims what the old one left
    streams.publish(r, W, output_ttl_s=60, status=status("run-2"), status_ttl_s=5, run_id="run-2")
    assert streams.publish(r, W, output_ttl_s=60, chunks=[chunk("old-run", 0)], owners={"old-run": d.ack},
                           run_id="run-1") == [d.ack]


def test_a_claim_that_redis_broke_off_is_taken_up_without_claiming_twice(r):
    """A worker's claim at start failed part way (Redis went away): the retry skips the entries the first try
    took, so their delivery count (the owner token of the jobs already running) stays as it was."""
    first, second = taken(r, "first"), taken(r, "second")
    [got] = [d for d in streams.claim_pending(r, first.stream, W, W, min_idle_ms=0) if d.entry_id == first.entry_id]
    counts = {p["message_id"]: p["times_delivered"] for p in r.xpending_range(first.stream, keys.GROUP, "-", "+", 10)}
    again = streams.claim_pending(r, first.stream, W, W, min_idle_ms=0, skip={got.entry_id})
    assert [d.entry_id for d in again] == [second.entry_id]
    after = {p["message_id"]: p["times_delivered"] for p in r.xpending_range(first.stream, keys.GROUP, "-", "+", 10)}
    assert after[first.entry_id] == counts[first.entry_id] == got.deliveries
    assert after[second.entry_id] == counts[second.entry_id] + 1


@pytest.mark.usefixtures("quick_silence_check")
def test_a_relay_whose_entry_was_acked_without_its_final_chunk_is_lost(r, redis_url):
    """A final chunk dropped on its way (written while the inbox was missing), its entry acked: after
    SILENCE_CHECK_S without a chunk the relay finds the entry gone and ends with OutputLost (placed again);
    while the entry is there it waits."""

    async def main():
        ar = streams.connect_async(redis_url)
        inbox = Inbox(ar, "gw", ttl_s=60, block_ms=100)
        await inbox.start()
        d = taken(r, "dropped")
        inbox.open("dropped")
        streams.publish(r, W, output_ttl_s=60, chunks=[chunk("dropped", 0)], reply_to={"dropped": inbox.gateway_id})
        relay = asyncio.ensure_future(collect(inbox, "dropped", timeout_s=30, entry=(d.stream, d.entry_id)))
        await asyncio.sleep(1.0)
        assert not relay.done(), "the entry is there: it waits"
        streams.ack_and_delete(r, d.ack)
        with pytest.raises(streams.OutputLost, match="final chunk never came"):
            await asyncio.wait_for(relay, 5)
        await inbox.close()
        await ar.aclose()

    run(main())


@pytest.mark.usefixtures("quick_silence_check")
def test_a_relay_follows_its_request_when_a_worker_moves_it(r, redis_url):
    """A worker hands a gateway's request back to the shared queue (a drain), or forwards it to another worker:
    its old entry is acked and gone, and a `moved` entry in the gateway's inbox names the new one. Past
    SILENCE_CHECK_S without a chunk the relay checks the new entry, finds it, and keeps waiting (no OutputLost:
    placing it again would run it twice); the chunks of whoever runs it then reach it."""
    from shared.streams.worker import forward

    async def main():
        ar = streams.connect_async(redis_url)
        inbox = Inbox(ar, "gw-moved", ttl_s=60, block_ms=100)
        await inbox.start()
        relays = {}
        for rid in ("handed", "forwarded"):
            inbox.open(rid)
            d = taken(r, rid, reply_to=inbox.gateway_id)
            relays[rid] = (asyncio.ensure_future(collect(inbox, rid, timeout_s=30, entry=(d.stream, d.entry_id))),
                           d)
        handed, forwarded = relays["handed"][1], relays["forwarded"][1]
        requeued = [(streams.parse_request(handed.fields), handed.ack)]
        assert streams.publish(r, W, output_ttl_s=60, requeued=requeued, run_id="run-1") == []
        forward(r, streams.parse_request(forwarded.fields), "w-other", forwarded.ack)
        assert r.xlen(handed.stream) == 0 and r.xlen(keys.req_any()) == 1 and r.xlen(keys.req_stream("w-other")) == 1
        await asyncio.sleep(1.2)  # several silence checks
        assert not any(task.done() for task, _ in relays.values()), [t.exception() for t, _ in relays.values()
                                                                      if t.done()]
        streams.publish(r, "w-other", output_ttl_s=60, reply_to={"handed": inbox.gateway_id, "forwarded": inbox.gateway_id},
                        chunks=[chunk("handed", 0, final=True), chunk("forwarded", 0, final=True)])
        for rid, (task, _) in relays.items():
            assert [c.seq for c in await asyncio.wait_for(task, 5)] == [0], rid
        await inbox.close()
        await ar.aclose()

    run(main())
