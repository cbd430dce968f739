"""shared.streams' fleet reads and prefix index against a real Redis (no fleet): what the gateway routes on
(aread_fleet), the snapshot GET /v1/fleet, `kvfleet status` / `top` and the gateway's gauges show, and where
prompt prefixes were routed."""

from __future__ import annotations

import asyncio
import time

import pytest
from fleet_harness import run_async as run

from gateway.router import prefix_overlap
from services.redis_server import RedisServer
from shared import keys, streams
from shared.blocks import block_hashes
from shared.fleet_state import FleetView
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_url():
    with RedisServer() as srv:
        yield srv.url


def status(wid: str, free: int) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, model="tiny", max_model_len=256, block_size=16, total_blocks=64,
                        free_blocks=free)


def test_fleet_view_and_snapshot(redis_url):
    async def body(r):
        assert await streams.aread_fleet(r) == FleetView()
        await r.sadd(keys.workers(), "w0", "w1")  # w1 was seen once; its status expired
        await r.set(keys.status("w0"), status("w0", 40).model_dump_json())
        await streams.aenqueue(r, GenerationRequest(request_id="a", prompt_token_ids=[1], kv_blocks=3), "w0")
        await streams.aenqueue(r, GenerationRequest(request_id="b", prompt_token_ids=[1], kv_blocks=2), "w0")
        await r.xgroup_create(keys.req_stream("w0"), keys.GROUP, id="0")
        await r.xreadgroup(keys.GROUP, "w0", {keys.req_stream("w0"): ">"}, count=1)  # taken, not yet acked
        view = await streams.aread_fleet(r)
        assert [w.worker_id for w in view.live] == ["w0"] and view.dead == ["w1"]
        assert view.reservations == {"w0": 5}

        snap = await streams.afleet_snapshot(r)
        (w0,) = snap["workers"]
        assert w0["worker_id"] == "w0" and w0["free_blocks"] == 40 and w0["reserved_blocks"] == 5
        assert 0 <= w0["heartbeat_age_s"] < 5
        assert snap["dead_workers"] == ["w1"] and snap["dead_letters"] == 0
        assert snap["streams"] == {keys.req_any(): {"length": 0, "pending": 0},  # no such stream yet
                                   keys.req_stream("w0"): {"length": 2, "pending": 1},
                                   keys.req_stream("w1"): {"length": 0, "pending": 0}}
        assert [await streams.anext_turn(r) for _ in range(3)] == [1, 2, 3]

    run(redis_url, body)


def test_prefix_index_remembers_where_blocks_went(redis_url):
    async def body(r):
        a = block_hashes(list(range(40)), 16, "m")
        b = block_hashes(list(range(32)) + [99] * 20, 16, "m")
        assert await streams.aprefix_owners(r, []) == []
        assert await streams.aprefix_owners(r, b) == [[], [], []]
        await streams.aremember_prefix(r, b, "w2")
        await streams.aremember_prefix(r, a, "w1")  # a and b share their first two blocks
        owners = await streams.aprefix_owners(r, b)
        assert owners == [["w1", "w2"], ["w1", "w2"], ["w2"]] and prefix_overlap(owners) == {"w1": 2, "w2": 3}
        assert 0 < await r.ttl(keys.prefix_block(a[0], a[0])) <= streams.PREFIX_TTL_S
        # a hot prompt outgrows w1: each worker it goes to is kept, most recent first, up to PREFIX_OWNERS
        for w in ("w3", "w1", "w4", "w5", "w6"):
            await streams.aremember_prefix(r, a, w)
        assert await streams.aprefix_owners(r, a) == [["w6", "w5", "w4", "w1"]] * 2
        assert streams.PREFIX_OWNERS == 4

    run(redis_url, body)


def test_what_a_foreign_writer_leaves_is_left_out_of_the_fleet_reads(redis_url):
    """streams.plant_foreign_state (the chaos soak's `foreign_writes`): the planted worker is neither live nor dead
    but unreadable, while its status lasts; the cancel reader skips the planted entry; a reservation on a live
    worker that is not a block count counts nothing, in the fleet's read and in the enqueue's check, and the
    reservations that are counts still count (but one over the worker's whole cache, which made it look full for
    as long as gateways reserved there); the shards' set and the round-robin counter go on past what was
    planted in them."""
    async def body(r):
        await r.set(keys.status("w0"), status("w0", 40).model_dump_json())
        await r.sadd(keys.workers(), "w0")
        total = status("w0", 40).total_blocks  # a reservation over the whole cache counts nothing
        await r.hset(keys.reserved("w0"), mapping={"real": 3, "negative": -30, "fraction": "2.5",
                                                   "over the cache": total + 1})
        sync = streams.connect(redis_url)
        try:
            cursor = streams.cancel_cursor(sync)
            streams.plant_foreign_state(sync, "w-foreign", ttl_s=0.5, beside="w0")
            streams.cancel(sync, "real")
            assert streams.read_cancels(sync, cursor, block_ms=10)[1] == ["real"]
        finally:
            sync.close()
        view = await streams.aread_fleet(r)
        assert [w.worker_id for w in view.live] == ["w0"] and view.dead == []
        assert view.reservations == {"w0": 3}
        # the enqueue's own check agrees: 40 free - 3 reserved leave room for 35 blocks and a headroom of 2, not 36
        wants = [GenerationRequest(request_id=rid, prompt_token_ids=[1], kv_blocks=blocks) for rid, blocks in
                 (("too-big", 36), ("fits", 35))]
        placed = [await streams.aenqueue_routed(r, q, "w0", 0, min_headroom=2) for q in wants]
        assert placed[0] is None and placed[1] is not None
        assert await streams.aread_shards(r) == [0]  # the planted member is no shard
        assert [await streams.anext_turn(r) for _ in range(3)] == [1, 2, 3]  # the planted counter starts again
        assert view.unreadable == {"w-foreign": "model: Field required (and 4 more)"}
        assert (await streams.afleet_snapshot(r))["unreadable_workers"] == view.unreadable
        await asyncio.sleep(0.6)  # its status expired: a dead worker, for the takeover to look at and forget
        view = await streams.aread_fleet(r)
        assert view.unreadable == {} and view.dead == ["w-foreign"]

    run(redis_url, body)


def test_keys_of_another_type_are_left_out_not_raised(redis_url):
    """Another version (or program) may keep a worker's status or reservations in another Redis type (a hash, a
    string). The gateway's read of the fleet takes such a status for unreadable (it raised WRONGTYPE, a 500 for every
    request), and so do the workers (MGET gave nil: they took a live worker of another version for dead and took its
    requests over); the enqueue script refuses that worker instead of failing. Reservations of another type count
    none, and the enqueue goes on without writing one there."""
    async def body(r):
        for w, free in (("w0", 40), ("w1", 40)):
            await r.set(keys.status(w), status(w, free).model_dump_json())
            await r.sadd(keys.workers(), w)
        await r.delete(keys.status("w1"))
        await r.hset(keys.status("w1"), mapping={"free_blocks": 40})  # another version's status: a hash
        await r.set(keys.reserved("w0"), "3")  # another version's reservations: a string
        view = await streams.aread_fleet(r)
        assert [w.worker_id for w in view.live] == ["w0"] and view.dead == []
        assert view.unreadable == {"w1": "its key is not a string (WRONGTYPE)"}
        assert view.reservations == {"w0": 0}
        sync = streams.connect(redis_url)
        try:
            assert set(streams.other_workers(sync, "w-me")) == {"w0"}  # w1 neither live nor dead
        finally:
            sync.close()
        request = GenerationRequest(request_id="r", prompt_token_ids=[1], kv_blocks=2)
        assert await streams.aenqueue_routed(r, request, "w1", 0, min_headroom=2) is None
        assert await streams.aenqueue_routed(r, request, "w0", 0, min_headroom=2) is not None
        assert await r.get(keys.reserved("w0")) == "3"  # left as it was

    run(redis_url, body)


def test_a_worker_back_after_its_status_expired_is_seen_at_once_around_a_workers_set_of_another_type(redis_url):
    """The shard's workers set is another program's string, so the fleet read finds the workers by a SCAN of their
    status keys, which it keeps for RECHECK_S. Chaos seed 257 paused Redis past the status TTL: a scan made as Redis
    came back found none of the three workers (their statuses had expired; another version's status was there), and
    the gateway, which waits two heartbeats for them to re-register, got no live worker from that kept scan and
    answered 503 no_workers. A scan that leads to no live worker is not kept now; one that found a live worker is."""
    async def body(r):
        await r.set(keys.workers(0), "another program's string")
        await r.set(keys.status("w-foreign"), '{"free_blocks": 1}')  # another version's status, unreadable here
        view = await streams.aread_fleet(r)  # Redis is back; w0's status expired while it was away
        assert view.live == [] and list(view.unreadable) == ["w-foreign"]
        await r.set(keys.status("w0"), status("w0", 40).model_dump_json())  # w0's next heartbeat
        assert [w.worker_id for w in (await streams.aread_fleet(r)).live] == ["w0"]
        await r.delete(keys.status("w-foreign"), keys.status("w0"))
        assert (await streams.aread_fleet(r)).live == []  # no status at all: the scan found none
        await r.set(keys.status("w0"), status("w0", 40).model_dump_json())
        assert [w.worker_id for w in (await streams.aread_fleet(r)).live] == ["w0"]
        await r.set(keys.status("w1"), status("w1", 40).model_dump_json())  # registers after a scan that found w0
        assert [w.worker_id for w in (await streams.aread_fleet(r)).live] == ["w0"]  # kept: w1 at the next scan

    run(redis_url, body)


FOREIGN_PX = 300  # ms: another program's string in one of kvfleet's keys, which expires as an operator would delete it


def looked_at_after_it_expired(real, before_the_look=None):
    """`real` (streams' find or afind, which TYPEs the keys a read refused for their type) run once the foreign
    strings planted with FOREIGN_PX have expired, and after `before_the_look` (a worker's next status, say): what a
    Redis paused between the refused read and the look does (chaos seed 229)."""
    if asyncio.iscoroutinefunction(real):
        async def slow(r, names):
            await asyncio.sleep(2 * FOREIGN_PX / 1000)
            if before_the_look is not None:
                await before_the_look(r)
            return await real(r, names)
        return slow

    def slow_sync(r, names):
        time.sleep(2 * FOREIGN_PX / 1000)
        if before_the_look is not None:
            before_the_look(r)
        return real(r, names)
    return slow_sync


def test_a_set_whose_other_type_is_gone_by_the_time_it_is_looked_at_is_read_again(redis_url, monkeypatch):
    """The workers set (and kvfleet:shards) held another program's string when the fleet read was refused, and the
    string expired before the TYPE that looks for it (Redis paused between them: chaos seed 229). The look finds no
    key of another type, and the read raised the bare WRONGTYPE: the gateway answered 503 redis_key_of_another_type
    from a fleet with live workers. Now the set is read again, as the worker's next status left it."""
    from shared.streams import key_types

    async def the_worker_registers_again(r):
        await r.sadd(keys.workers(), "w0")
        await r.sadd(keys.SHARDS, "0")

    monkeypatch.setattr(key_types, "afind", looked_at_after_it_expired(key_types.afind, the_worker_registers_again))

    async def body(r):
        await r.set(keys.status("w0"), status("w0", 40).model_dump_json())
        for name in (keys.workers(), keys.SHARDS):
            await r.set(name, "another program's", px=FOREIGN_PX)
        view = await streams.aread_fleet(r)
        assert [w.worker_id for w in view.live] == ["w0"] and await r.type(keys.workers()) == "set"

    run(redis_url, body)


def test_an_enqueue_refused_for_a_type_that_is_gone_by_the_time_it_is_looked_at_runs_again(redis_url, monkeypatch):
    """The same race for the enqueue scripts: a worker's stream (or the shared one) held another program's string when
    the routed (or shared) enqueue was refused, and the string expired before the look. The gateway answered 503
    redis_key_of_another_type once for a key no longer there. Now the script runs again (it wrote nothing before it
    met the other type) and enqueues once; a key still of another type is still named."""
    from shared.streams import key_types

    monkeypatch.setattr(key_types, "afind", looked_at_after_it_expired(key_types.afind))

    async def body(r):
        await r.set(keys.status("w0"), status("w0", 40).model_dump_json())
        for stream in (keys.req_stream("w0"), keys.req_any()):
            await r.set(stream, "another program's", px=FOREIGN_PX)
        routed = await streams.aenqueue_routed(r, GenerationRequest(request_id="a", prompt_token_ids=[1], kv_blocks=2),
                                               "w0", 0, min_headroom=0, lease_ttl_s=30)
        shared = await streams.aenqueue_shared(r, GenerationRequest(request_id="b", prompt_token_ids=[1]), 0,
                                               bound=8, lease_ttl_s=30)
        assert [e[0] for e in await r.xrange(keys.req_stream("w0"))] == [routed]
        assert [e[0] for e in await r.xrange(keys.req_any())] == [shared]
        assert await r.hgetall(keys.reserved("w0")) == {"a": "2"}
        await r.set(keys.req_any(), "another program's")  # one that stays: named, nothing enqueued
        with pytest.raises(streams.KeyOfAnotherType) as named:
            await streams.aenqueue_shared(r, GenerationRequest(request_id="c", prompt_token_ids=[1]), 0, bound=8)
        assert named.value.key == keys.req_any()

    run(redis_url, body)


def test_the_takeover_scan_and_an_output_reader_read_again_past_a_type_that_changed_back(redis_url, monkeypatch):
    """The same race for a worker's takeover scan (the shard's workers set) and for a request's output reader (its
    output stream: another program's string there, gone by the time it is looked at, then the worker's output): each
    reads again instead of failing its turn, or the request."""
    from shared.streams import key_types, output, shard_members

    sync = streams.connect(redis_url)
    try:
        sync.set(keys.status("w0"), status("w0", 40).model_dump_json())
        sync.set(keys.workers(), "another program's", px=FOREIGN_PX)
        monkeypatch.setattr(key_types, "find", looked_at_after_it_expired(key_types.find,
                                                                          lambda r: r.sadd(keys.workers(), "w0")))
        assert shard_members.shard_workers(sync) == {"w0"}

        sync.set(keys.out_stream("typed"), "another program's", px=FOREIGN_PX)
        written = [OutputChunk(request_id="typed", seq=0, token_ids=[5], text="a", worker_id="w0", delivery=1),
                   OutputChunk(request_id="typed", seq=1, token_ids=[6], text="b", worker_id="w0", delivery=1,
                               final=True, finish_reason="stop")]
        monkeypatch.setattr(output, "find", looked_at_after_it_expired(
            output.find, lambda r: streams.publish(r, "w0", output_ttl_s=60, chunks=written)))
        assert [c.text for c in streams.iter_output(sync, "typed", timeout_s=10)] == ["a", "b"]
    finally:
        sync.close()
