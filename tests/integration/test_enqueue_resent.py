"""An enqueue whose reply is lost is sent again by redis-py (the gateway's client, and the services' (Celery, the
Python client, batch files), retry a command on a connection error): Redis ran it, and runs it again. Against a real
Redis, with the reply of the first run dropped as a killed connection drops it (read, then ConnectionError): the
request is enqueued once, its blocks reserved once, and both runs answer the same entry id, whether the request holds
a lease (the gateway's: the mark is in the lease) or not (the services' jobs: a mark key of its own, which expires).
A new call for the same request (placing it again) still enqueues."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions
from redis.asyncio.connection import Connection
from redis.connection import Connection as SyncConnection

from shared import keys, streams
from shared.messages import DeadLetter, GenerationRequest, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


def request(rid: str, leased: bool) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="tiny", prompt_token_ids=[1, 2, 3],
                             sampling_params=SamplingParams(max_tokens=4).to_dict(), kv_blocks=2, lease=leased)


def lose_the_next_script_reply(monkeypatch, connection: type = Connection) -> list[str]:
    """The next EVALSHA's reply is read off the socket, then lost: a ConnectionError as from a killed connection
    (redis-py's asyncio `connection` class, or its sync one). -> the commands sent meanwhile (the resend lands
    there)."""
    sent: list[str] = []
    send, read = connection.send_command, connection.read_response
    state = {"armed": False}

    def arm(args) -> None:
        sent.append(str(args[0]))
        state["armed"] = state["armed"] or (str(args[0]).upper() == "EVALSHA" and len(sent) == 1)

    def lose() -> bool:
        if state["armed"]:
            state["armed"] = None  # once
            return True
        return False

    lost = redis.exceptions.ConnectionError("the reply was lost (the connection died after Redis ran it)")
    if connection is Connection:
        async def send_command(self, *args, **kw):
            arm(args)
            return await send(self, *args, **kw)

        async def read_response(self, *args, **kw):
            reply = await read(self, *args, **kw)
            if lose():
                await self.disconnect()
                raise lost
            return reply
    else:
        def send_command(self, *args, **kw):
            arm(args)
            return send(self, *args, **kw)

        def read_response(self, *args, **kw):
            reply = read(self, *args, **kw)
            if lose():
                self.disconnect()
                raise lost
            return reply

    monkeypatch.setattr(connection, "send_command", send_command)
    monkeypatch.setattr(connection, "read_response", read_response)
    return sent


@pytest.mark.parametrize("leased", [True, False], ids=["leased", "no-lease"])
@pytest.mark.parametrize("routed", [True, False], ids=["worker-stream", "shared-stream"])
def test_an_enqueue_sent_again_after_its_reply_was_lost_enqueues_once(redis_url, monkeypatch, routed, leased):
    ttl = 30 if leased else None

    async def enqueue(r, req):
        if routed:
            return await streams.aenqueue_routed(r, req, "w0", 0, min_headroom=0, queue_bound=8, lease_ttl_s=ttl)
        return await streams.aenqueue_shared(r, req, 0, bound=8, lease_ttl_s=ttl)

    async def main() -> None:
        r = streams.connect_async(redis_url)
        try:
            await r.flushdb()
            status = WorkerStatus(worker_id="w0", model="tiny", max_model_len=4096, block_size=16, total_blocks=100,
                                  free_blocks=100)
            await r.set(keys.status("w0"), status.model_dump_json())
            stream = keys.req_stream("w0") if routed else keys.req_any(0)
            await enqueue(r, request("warm", leased))  # the script loaded, a connection open
            await r.delete(stream, keys.reserved("w0"))
            sent = lose_the_next_script_reply(monkeypatch)
            entry = await enqueue(r, request("a", leased))
            monkeypatch.undo()
            assert [c.upper() for c in sent].count("EVALSHA") == 2  # redis-py did send it again
            entries = await r.xrange(stream)
            assert [e for e, _ in entries] == [entry]  # once, and the id both runs answered
            if routed:
                assert await r.hgetall(keys.reserved("w0")) == {"a": "2"}
            if leased:  # the lease holds the mark; no key of its own
                assert await r.exists(keys.lease("a")) and not await r.exists(keys.enqueued("a"))
            else:  # the mark expires on its own; no lease, which would tell the worker someone reads it
                assert not await r.exists(keys.lease("a"))
                ttl_ms = streams.ENQUEUE_MARK_TTL_S * 1000
                assert ttl_ms - 5_000 < await r.pttl(keys.enqueued("a")) <= ttl_ms
            again = await enqueue(r, request("a", leased))  # a new call: the request placed again on purpose
            assert again != entry and len(await r.xrange(stream)) == 2
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_forward_sent_again_after_its_reply_was_lost_enqueues_once(redis_url, monkeypatch):
    """A worker's forward of a request its cache cannot hold (shared.streams.forward: enqueue on another worker and
    ack here, one step) is marked as the enqueues are: sent again, it enqueues nothing twice."""
    r = streams.connect(redis_url)  # the worker's main client: it sends a command again after a connection error
    try:
        r.flushdb()
        streams.ensure_group(r, keys.req_any())
        for rid in ("warm", "long"):
            streams.enqueue(r, request(rid, leased=True), None)
        warm, long = streams.read_requests(r, "w-me", {keys.req_any(): ">"}, count=2)
        streams.forward(r, request("warm", leased=True), "w-big", warm.ack)  # the script loaded, a connection open
        r.delete(keys.req_stream("w-big"))
        sent = lose_the_next_script_reply(monkeypatch, SyncConnection)
        entry = streams.forward(r, request("long", leased=True), "w-big", long.ack)
        monkeypatch.undo()
        assert [c.upper() for c in sent].count("EVALSHA") == 2  # redis-py did send it again
        assert [e for e, _ in r.xrange(keys.req_stream("w-big"))] == [entry]
        assert r.xlen(keys.req_any()) == 0 and r.xpending(keys.req_any(), keys.GROUP)["pending"] == 0
        assert not r.exists(keys.lease("long"))  # the gateway's lease is the gateway's: a forward leaves it be
    finally:
        r.close()


def test_a_job_record_claim_and_promote_sent_again_after_the_reply_was_lost_stay_ours(redis_url, monkeypatch):
    """A services' placement (Celery, the Python client, batch files) claims the request id's job record, then
    promotes it once enqueued (services.job_record). Sent again after a lost reply, the claim finds its own record:
    not "held" (which would have the caller wait out its own lease, then take it over), but a takeover of nothing
    known, so the caller looks for the request in the fleet before placing it; the promote answers replaced."""
    from services import job_record
    from services.job_record import Claim

    async def main() -> None:
        r = streams.connect_async(redis_url)
        try:
            await r.flushdb()
            warm = await job_record.claim(r, "warm", ttl_s=60)  # the scripts loaded, a connection open
            await job_record.promote(r, "warm", warm.lease, {}, ttl_s=60)
            sent = lose_the_next_script_reply(monkeypatch)
            claimed = await job_record.claim(r, "job-1", ttl_s=60)
            monkeypatch.undo()
            assert [c.upper() for c in sent].count("EVALSHA") == 2
            assert claimed.outcome is Claim.TAKEN_OVER and claimed.held is None
            assert await r.get(keys.job("job-1")) == claimed.lease  # ours, written once
            sent = lose_the_next_script_reply(monkeypatch)
            promoted = await job_record.promote(r, "job-1", claimed.lease, {"kind": "completion"}, ttl_s=60)
            monkeypatch.undo()
            assert [c.upper() for c in sent].count("EVALSHA") == 2 and promoted
            assert (await job_record.get(r, "job-1")).state == "enqueued"
            assert (await job_record.claim(r, "job-1", ttl_s=60)).outcome is Claim.HELD  # another attempt: held
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_lease_refresh_sent_again_after_its_reply_was_lost_still_finds_the_lease_gone(redis_url, monkeypatch):
    """The gateway's lease refresh sets every lease it holds and learns which were gone (Redis lost the request).
    Its reply lost and the script sent again, the second run found the lease the first had just set: with a plain
    SET ... GET, a lost request went unnoticed and its client waited out the request timeout. The refresh marks its
    call in the value, so the run sent again answers what the first found."""
    async def main() -> None:
        r = streams.connect_async(redis_url)
        try:
            await r.flushdb()
            await r.set(keys.lease("kept"), 1, px=30_000)
            await streams.ahold_leases(r, {"warm": 0}, 30.0)  # the script loaded, a connection open
            sent = lose_the_next_script_reply(monkeypatch)
            gone, full = await streams.ahold_leases(r, {"kept": 0, "lost": 0}, 30.0)
            monkeypatch.undo()
            assert [c.upper() for c in sent].count("EVALSHA") == 2  # redis-py did send it again
            assert gone == {"lost"} and not full
            assert 20_000 < await r.pttl(keys.lease("lost")) <= 30_000  # set again, as before
            gone, _ = await streams.ahold_leases(r, {"kept": 0, "lost": 0}, 30.0)  # the next call: both there
            assert gone == set()
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_dead_letter_sent_again_is_kept_once(redis_url, monkeypatch):
    """A worker's dead letter whose reply is lost is sent again by redis-py, and a flush that failed is sent again by
    the worker's outbox: kvfleet:dead got the letter twice, and counted two requests dead for one."""
    r = streams.connect(redis_url)  # the worker's main client: it sends a command again after a connection error
    try:
        r.flushdb()
        letter = DeadLetter(request=request("poison", leased=False), reason="the forward failed for it alone",
                            deliveries=1, worker_id="w0")
        streams.dead_letter(r, DeadLetter(reason="warm", deliveries=1, worker_id="w0"))  # the script loaded
        sent = lose_the_next_script_reply(monkeypatch, SyncConnection)
        streams.dead_letter(r, letter)
        monkeypatch.undo()
        assert [c.upper() for c in sent].count("EVALSHA") == 2  # redis-py did send it again
        streams.dead_letter(r, letter)  # the outbox's own retry of the same letter
        letters = [DeadLetter.model_validate_json(f[keys.FIELD]) for _, f in r.xrange(keys.DEAD)]
        assert [(x.reason, x.request and x.request.request_id) for x in letters] == [
            ("warm", None), ("the forward failed for it alone", "poison")]
        again = letter.model_copy(update={"time": letter.time + 1, "deliveries": 2})  # a new letter for it: kept
        streams.dead_letter(r, again)
        assert r.xlen(keys.DEAD) == 3
    finally:
        r.close()
