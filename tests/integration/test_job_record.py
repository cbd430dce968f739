"""services.job_record against a real Redis (no fleet): the claim / take-over / promote / release protocol
that lets a request id enter the fleet at most once, and the scan that finds an enqueued request
(shared.streams.arequest_in_fleet)."""

from __future__ import annotations

import asyncio

import pytest
from fleet_harness import run_async as run

from services import job_record
from services.job_record import Claim
from shared import keys, streams
from shared.messages import GenerationRequest, OutputChunk

pytestmark = pytest.mark.integration


def test_one_claim_wins_and_the_others_attach(redis_url):
    async def body(r):
        claims = await asyncio.gather(*[job_record.claim(r, "j1", ttl_s=60) for _ in range(8)])
        assert sorted(c.outcome.value for c in claims) == [0] * 7 + [1]
        mine = next(c for c in claims if c.outcome is Claim.FRESH)
        assert all(c.held.state == "placing" for c in claims if c is not mine)
        waiter = asyncio.create_task(job_record.wait_placed(r, "j1"))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        assert await job_record.promote(r, "j1", mine.lease, {"kind": "completion"}, ttl_s=60)
        rec = await waiter
        assert rec.state == "enqueued" and rec.call == {"kind": "completion"}
        assert not await job_record.promote(r, "j1", mine.lease, {}, ttl_s=60)  # not a placing lease any more
        await job_record.finish(r, "j1", 0, {"kind": "completion"}, {"id": "j1"}, ttl_s=60, output_ttl_s=1)
        again = await job_record.claim(r, "j1", ttl_s=60)
        assert again.outcome is Claim.HELD and again.held.result == {"id": "j1"}
        assert 0 < await r.pttl(keys.job("j1")) <= 60_000

    run(redis_url, body)


def test_release_lets_the_next_attempt_claim_and_a_stale_lease_is_taken_over(redis_url):
    async def body(r):
        first = await job_record.claim(r, "j2", ttl_s=60)
        await job_record.release(r, "j2", "not my lease")
        assert (await job_record.get(r, "j2")).state == "placing"  # someone else's lease stays
        await job_record.release(r, "j2", first.lease)
        assert await job_record.get(r, "j2") is None
        assert (await job_record.claim(r, "j2", ttl_s=60)).outcome is Claim.FRESH
        held = await job_record.claim(r, "j2", ttl_s=60, lease_s=10)
        assert held.outcome is Claim.HELD
        await asyncio.sleep(0.05)
        assert await job_record.wait_placed(r, "j2", lease_s=0.01) is None  # its owner is gone
        assert (await job_record.claim(r, "j2", ttl_s=60, lease_s=0.01)).outcome is Claim.TAKEN_OVER

    run(redis_url, body)


def test_every_state_keeps_the_request_hash(redis_url):
    """placing -> enqueued -> done carry the hash of what the id stands for; a taken-over lease shows the dead
    attempt's hash (its enqueued request may be another body); records without one match any request."""
    async def body(r):
        first = await job_record.claim(r, "j5", ttl_s=60, request_hash="h1")
        assert (await job_record.get(r, "j5")).request_hash == "h1"
        assert await job_record.promote(r, "j5", first.lease, {"kind": "completion"}, ttl_s=60)
        rec = await job_record.get(r, "j5")
        assert rec.state == "enqueued" and rec.same_request("h1") and not rec.same_request("h2")
        await job_record.finish(r, "j5", 0, {"kind": "completion"}, {"id": "j5"}, ttl_s=60, output_ttl_s=1,
                                request_hash="h1")
        held = await job_record.claim(r, "j5", ttl_s=60, request_hash="h2")
        assert held.outcome is Claim.HELD and held.held.request_hash == "h1" and not held.held.same_request("h2")

        await job_record.claim(r, "j6", ttl_s=60, request_hash="dead")
        await asyncio.sleep(0.05)
        taken = await job_record.claim(r, "j6", ttl_s=60, lease_s=0.01, request_hash="h2")
        assert taken.outcome is Claim.TAKEN_OVER and taken.held.request_hash == "dead"
        assert job_record.Record(state="done", since=0.0).same_request("anything")

    run(redis_url, body)


def test_in_fleet_finds_a_request_in_any_stream_or_by_its_output(redis_url):
    async def body(r):
        await r.sadd(keys.workers(), "w0", "w1")
        for i in range(600):  # more than a page of other requests before it
            await streams.aenqueue(r, GenerationRequest(request_id=f"other-{i}", prompt_token_ids=[1]), "w1")
        assert await streams.arequest_in_fleet(r, "j3") is None
        await streams.aenqueue(r, GenerationRequest(request_id="j3", prompt_token_ids=[1]), "w1")
        assert await streams.arequest_in_fleet(r, "j3") == 0
        await streams.aenqueue(r, GenerationRequest(request_id="j4", prompt_token_ids=[1]), None)
        assert await streams.arequest_in_fleet(r, "j4") == 0
        assert await streams.arequest_in_fleet(r, "j5") is None
        await r.xadd(keys.out_stream("j5"), {keys.FIELD: OutputChunk(request_id="j5", seq=0).model_dump_json()})
        assert await streams.arequest_in_fleet(r, "j5") == 0  # taken, finished and acked: only its output is left
        assert await streams.arequest_in_fleet(r, "j") is None  # a prefix of other ids is not a match

    run(redis_url, body)


def test_a_done_record_keeps_the_answer_not_a_copy_of_the_request(redis_url):
    prompt_ids = list(range(4000))
    request = GenerationRequest(request_id="j-big", prompt_token_ids=prompt_ids, prompt="word " * 4000).model_dump()
    call = {"kind": "completion", "model": "m", "tokenizer": "m", "request": request}
    result = {"id": "j-big", "choices": [{"index": 0, "text": "short answer", "finish_reason": "length"}],
              "usage": {"prompt_tokens": 4000, "completion_tokens": 2, "total_tokens": 4002}}

    async def body(r):
        await job_record.finish(r, "j-big", 0, call, result, ttl_s=60, output_ttl_s=1)
        raw = await streams.aget_job(r, "j-big")
        rec = await job_record.get(r, "j-big")
        assert rec.state == "done" and rec.result == result and rec.call["request"] == {}
        assert rec.call["kind"] == "completion"
        assert len(raw) < 1000, f"a done record of {len(raw)} bytes holds more than its answer"

    run(redis_url, body)


@pytest.mark.parametrize("raw", ["", "not json", "1e9", "[1, 2]", '{"a": 1}', '{"state": "done", "since": 1}',
                                 '{"state": "enqueued", "since": "yesterday", "call": {}}',
                                 '{"state": "running", "since": 1, "call": {}}'])
def test_a_record_another_program_wrote_is_taken_over(redis_url, raw, caplog):
    """A job record this version cannot read (not JSON, not an object, unknown fields or state, an enqueued or done
    record without what it must hold) counts as a dead attempt's: `get` finds none, and the next claim takes it over
    (the caller then looks for the request in the fleet before placing it), where a Celery task failed on it at
    every retry. The claim in Lua and Record.parse read it by the same rules."""
    async def body(r):
        await r.set(keys.job("j"), raw)
        assert await job_record.get(r, "j") is None
        claimed = await job_record.claim(r, "j", ttl_s=60)
        assert claimed.outcome is Claim.TAKEN_OVER and claimed.held is None
        assert await r.get(keys.job("j")) == claimed.lease
        assert "the job record of request j cannot be read" in caplog.text

    run(redis_url, body)


def test_a_readable_record_of_each_state_is_held(redis_url):
    """The same rules keep every record this version writes: a live placing lease, an enqueued one, a done one."""
    async def body(r):
        placing = await job_record.claim(r, "p", ttl_s=60)
        enqueued = await job_record.claim(r, "e", ttl_s=60)
        assert await job_record.promote(r, "e", enqueued.lease, {"kind": "chat"}, ttl_s=60)
        await job_record.finish(r, "d", 0, {"kind": "chat"}, {"id": "d"}, ttl_s=60, output_ttl_s=1)
        for rid, state in (("p", "placing"), ("e", "enqueued"), ("d", "done")):
            assert (await job_record.get(r, rid)).state == state
            again = await job_record.claim(r, rid, ttl_s=60)
            assert again.outcome is Claim.HELD and again.held.state == state, rid
        assert await r.get(keys.job("p")) == placing.lease

    run(redis_url, body)


def test_a_later_versions_record_with_a_field_more_is_read_and_held(redis_url):
    """A record a later kvfleet version wrote, with a field this one does not know, is read (the field left aside)
    and held: its request is attached to, not taken over and placed again (before, the claim raised TypeError)."""
    async def body(r):
        await r.set(keys.job("later"), '{"state": "enqueued", "since": 1, "owner": "o", "call": {"kind": "chat"}, '
                                       '"result": null, "request_hash": "h", "tenant": "t1"}')
        rec = await job_record.get(r, "later")
        assert (rec.state, rec.call, rec.request_hash) == ("enqueued", {"kind": "chat"}, "h")
        claimed = await job_record.claim(r, "later", ttl_s=60)
        assert claimed.outcome is Claim.HELD and claimed.held.call == {"kind": "chat"}

    run(redis_url, body)
