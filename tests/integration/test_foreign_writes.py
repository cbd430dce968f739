"""What another program (or another kvfleet version in a rolling upgrade) may write into kvfleet's per-worker and
per-request keys, against a real Redis: for each key kind and each of several foreign values (empty, not JSON, a
number out of range, JSON of another shape, bytes that are no UTF-8 text), every read the gateways, the services and
the workers make of the fleet still answers, and the enqueues still place or refuse. Each raised for some of them
before (a 500 for every request, a Celery task failing at every retry, a gateway's inbox reader stuck). The
fleet-wide sets and streams kept in another Redis type: tests/integration/test_keys_of_another_type.py."""

from __future__ import annotations

import pytest
from fleet_harness import run_async as run

from services import job_record
from shared import keys, streams
from shared.blocks import block_hashes
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

FOREIGN = ["", "x", "-1", "1e9", "99999999999999999999999", '{"a": 1}', "[1, 2]", b"\xff\xfe\x80"]
PROMPT = [1] * 40
HASHES = block_hashes(PROMPT, 16, "tiny")


async def plant(r, kind: str, value: str) -> None:
    if kind == "reservation":
        await r.hset(keys.reserved("w0"), "foreign", value)
    elif kind == "status":
        await r.set(keys.status("w0"), value)
    elif kind == "worker":
        await r.sadd(keys.workers(0), value or "-")
    elif kind == "shard":
        await r.sadd(keys.SHARDS, value or "-")
    elif kind == "turn":
        await r.set(keys.ROUND_ROBIN, value)
    elif kind == "job":
        await r.set(keys.job("j"), value)
    elif kind == "prefix":
        await r.set(keys.prefix_block(HASHES[0], HASHES[0]), value)
    elif kind == "status of another type":
        await r.delete(keys.status("w0"))
        await r.hset(keys.status("w0"), "free_blocks", value or "-")
    elif kind == "reservations of another type":
        await r.delete(keys.reserved("w0"))
        await r.set(keys.reserved("w0"), value)
    elif kind == "turn of another type":
        await r.rpush(keys.ROUND_ROBIN, value or "-")


@pytest.mark.parametrize("kind", ["reservation", "status", "worker", "shard", "turn", "job", "prefix",
                                  "status of another type", "reservations of another type", "turn of another type"])
def test_every_read_of_the_fleet_goes_on_past_a_foreign_value(redis_url, kind):
    async def body(r):
        sync = streams.connect(redis_url)
        try:
            for value in FOREIGN:
                await r.flushdb()
                status = WorkerStatus(worker_id="w0", model="tiny", max_model_len=256, block_size=16, total_blocks=64,
                                      free_blocks=60)
                await r.set(keys.status("w0"), status.model_dump_json())
                await r.sadd(keys.workers(0), "w0")
                await r.sadd(keys.SHARDS, 0)
                await plant(r, kind, value)
                view = await streams.aread_fleet(r)
                seen = {w.worker_id for w in view.live} | set(view.unreadable)
                assert seen == {"w0"} or kind == "worker" and "w0" in seen, (kind, value, view)
                await streams.afleet_snapshot(r)
                assert isinstance(await streams.anext_turn(r), int)
                assert len(await streams.aprefix_owners(r, HASHES)) == len(HASHES)
                request = GenerationRequest(request_id="q", prompt_token_ids=PROMPT, kv_blocks=3,
                                            sampling_params=SamplingParams(max_tokens=2).to_dict())
                placed = await streams.aenqueue_routed(r, request, "w0", 0, min_headroom=2, queue_bound=8,
                                                       lease_ttl_s=10)
                # refused: no readable status (a foreign reservation over the whole cache of 64 counts nothing)
                refused = kind.startswith("status")
                assert (placed is None) == refused, (kind, value)
                assert await streams.aenqueue_shared(r, request.model_copy(update={"request_id": "s"}), 0, bound=8)
                await job_record.get(r, "j")
                assert (await job_record.claim(r, "j", ttl_s=60)).lease
                assert await streams.arequest_in_fleet(r, "s") == 0
                streams.other_workers(sync, "w-me", 0)
                streams.request_streams(sync, 0)
        finally:
            sync.close()

    run(redis_url, body)


def test_an_inbox_entry_that_is_no_utf8_is_skipped_by_both_clients(redis_url):
    """A gateway reads its inbox through redis-py's client and through its multiplexed connection. An entry of bytes
    that are no UTF-8 text failed the whole read (UnicodeDecodeError), so the inbox reader stayed on it for good and
    nothing reached that gateway's clients; now it is read with U+FFFD in place, refused as unreadable and skipped,
    and the chunks after it arrive."""
    async def body(r):
        inbox = keys.inbox("gw")
        await r.xadd(inbox, {keys.FIELD: b"\xff\xfe\x80"})
        good = OutputChunk(request_id="a", seq=0, text="ok")
        await r.xadd(inbox, {keys.FIELD: "[" + good.model_dump_json() + "]"})
        m = streams.multiplexed(redis_url)
        try:
            for client in (r, m):
                cursor, chunks, moves = await streams.aread_inbox(client, inbox, "0-0", block_ms=100)
                assert [c.text for c in chunks] == ["ok"] and moves == [], client
                assert cursor == (await r.xrange(inbox))[-1][0]
        finally:
            await m.aclose()

    run(redis_url, body)
