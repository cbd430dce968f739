"""gateway.leases alone, against a recording stand-in for the asyncio Redis client: every lease a gateway
holds is refreshed in one round trip per turn (a script per shard) (never one per request); released leases and those
no relay touched for max_idle_s are not refreshed; a failed refresh is retried soon. And the worker side's
rule (gpu_worker.serve.lease_watch): a lease must stay gone for LEASE_CONFIRM_S before its request is cancelled. A lease
found gone while its request's entry is still there lapsed in a stall: set again, not lost."""

from __future__ import annotations

import asyncio

import pytest
import redis

from gateway.leases import Leases
from gpu_worker.serve.lease_watch import LEASE_CONFIRM_S, LeaseWatch
from shared import keys, streams
from shared.streams.leases import _HOLD

pytestmark = pytest.mark.unit


class Pipe:
    def __init__(self, redis: FakeRedis):
        self.redis, self.ranges, self.pexpires = redis, [], []

    def pexpire(self, key, ms):
        self.pexpires.append(key)
        self.redis.expired.append((key, ms, len(self.redis.round_trips)))

    def xrange(self, stream, first, last):
        assert first == last  # one entry
        self.ranges.append((stream, first))

    async def execute(self, raise_on_error=True):
        if self.ranges:  # the entries of leases found gone: still there?
            self.redis.entry_trips.append(self.ranges)
            return [[(entry_id, {})] if (stream, entry_id) in self.redis.entries else []
                    for stream, entry_id in self.ranges]
        if self.redis.full:  # maxmemory under noeviction: PEXPIRE taken (the leases kept while full)
            return [int(key in self.redis.stored) for key in self.pexpires]
        self.redis.round_trips.append([])  # the PEXPIREs of output streams read to their end, alone
        return [1] * len(self.pexpires)


def place(leases: Leases, r: FakeRedis, rid: str) -> None:
    """What placing a request does to its lease: the enqueue sets it (a SET, here) with its stream entry, the
    gateway holds it."""
    r.stored.add(keys.lease(rid))
    r.entries.add(entry(rid))
    leases.hold(r, rid, entry(rid))


def entry(rid: str) -> tuple[str, str]:
    return keys.req_stream("w0"), f"1-{ord(rid[0])}"


class FakeRedis:
    def __init__(self):
        self.round_trips: list[list[tuple[str, int]]] = []
        self.fail = 0
        self.full = False
        self.stored: set[str] = set()  # lease keys Redis holds (none ever expire here)
        self.entries: set[tuple[str, str]] = set()  # request-stream entries not acked
        self.entry_trips: list[list[tuple[str, str]]] = []
        self.expired: list[tuple[str, int, int]] = []  # (key, ms, the round trip it went with)

    def pipeline(self, transaction):
        assert not transaction
        return Pipe(self)

    async def evalsha(self, sha, numkeys, *args):
        """The refresh's script (streams.leases._HOLD) on one shard's leases: set each, say which were there."""
        assert sha == _HOLD.sha
        names, (ms, _nonce) = list(args[:numkeys]), args[numkeys:]
        if self.full:  # maxmemory under noeviction: the SETs refused
            raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
        if self.fail:
            self.fail -= 1
            raise streams.CONNECTION_ERRORS[0]("Redis away")
        self.round_trips.append([(name, ms) for name in names])
        there = [int(name in self.stored) for name in names]
        self.stored |= set(names)
        return there


def refreshed(r: FakeRedis) -> list[set[str]]:
    return [{k for k, _ in trip} for trip in r.round_trips]


def test_every_held_lease_is_refreshed_in_one_round_trip_per_turn():
    async def go(r: FakeRedis) -> None:
        leases = Leases(ttl_s=0.3, max_idle_s=60)
        for rid in ("a", "b", "c"):
            place(leases, r, rid)  # no round trip of its own: the enqueue set the lease
        assert r.round_trips == []
        await asyncio.sleep(0.25)  # ~ttl/3: one refresh of all three
        leases.release("b")
        await asyncio.sleep(0.2)
        await leases.close()

    r = FakeRedis()
    asyncio.run(go(r))
    assert all(px == 300 for trip in r.round_trips for _, px in trip)
    trips, all3, kept = refreshed(r), {keys.lease(x) for x in "abc"}, {keys.lease("a"), keys.lease("c")}
    assert all(len(trip) == len(set(trip)) for trip in r.round_trips)  # one SET per lease and round trip
    released_at = trips.index(kept)
    assert released_at > 0 and trips[:released_at] == [all3] * released_at, trips
    assert trips[released_at:] == [kept] * (len(trips) - released_at), trips


def test_a_lease_found_gone_marks_its_request_lost_until_released_unless_its_entry_is_there():
    """Gone with its request's entry: lost (Redis lost its data, or the worker let it go and acked it). Gone while
    the entry is there (queued, or pending on its worker): the lease lapsed in a stall; the refresh's SET put it
    back and the request goes on."""
    async def go(r: FakeRedis) -> tuple[bool, bool, bool, bool]:
        leases = Leases(ttl_s=0.3, max_idle_s=60)
        for rid in ("kept", "flushed", "lapsed"):
            place(leases, r, rid)
        assert not leases.is_lost("flushed")
        r.stored -= {keys.lease("flushed"), keys.lease("lapsed")}
        r.entries.discard(entry("flushed"))  # Redis lost it (a restart without its data, a FLUSHALL)
        await asyncio.sleep(0.2)  # one refresh
        lost = leases.is_lost("flushed"), leases.is_lost("kept"), leases.is_lost("lapsed")
        leases.release("flushed")
        await leases.close()
        return (*lost, leases.is_lost("flushed"))

    r = FakeRedis()
    assert asyncio.run(go(r)) == (True, False, False, False)
    assert sorted(r.entry_trips[0]) == sorted([entry("flushed"), entry("lapsed")])  # one round trip for both
    assert keys.lease("lapsed") in r.stored  # set again


def test_a_lapsed_lease_a_full_redis_refuses_to_set_again_is_said_so_and_set_once_it_takes_writes(caplog):
    """Redis full (maxmemory, noeviction): the refresh keeps the leases there with PEXPIRE, and one that lapsed
    in a stall (its request's entry still there) cannot be set again. The log says that (not "set again"), the
    request is not marked lost, and the next refresh sets it once Redis takes writes again."""
    async def go(r: FakeRedis) -> tuple[bool, bool, bool]:
        leases = Leases(ttl_s=0.3, max_idle_s=60)
        for rid in ("kept", "lapsed"):
            place(leases, r, rid)
        r.stored.discard(keys.lease("lapsed"))
        r.full = True
        await asyncio.sleep(0.15)  # one refresh while full
        while_full = leases.is_lost("lapsed"), keys.lease("lapsed") in r.stored
        r.full = False
        await asyncio.sleep(0.1)  # the next one
        await leases.close()
        return (*while_full, keys.lease("lapsed") in r.stored)

    r = FakeRedis()
    with caplog.at_level("WARNING", logger="kvfleet.gateway"):
        assert asyncio.run(go(r)) == (False, False, True)
    said = [rec.getMessage() for rec in caplog.records]
    assert any("Redis is full: it refused to set them again" in m and "lapsed" in m for m in said), said
    assert sum("set again, lapsed" in m for m in said) == 1, said  # the refresh after: set again
    assert (keys.lease("kept"), 300, 0) in r.expired  # kept with PEXPIRE while full


def test_an_untouched_lease_is_dropped_and_a_failed_refresh_is_retried():
    async def go(r: FakeRedis) -> Leases:
        leases = Leases(ttl_s=0.3, max_idle_s=0.15)
        place(leases, r, "idle")
        place(leases, r, "busy")
        del r.round_trips[:]
        r.fail = 1
        for _ in range(8):
            await asyncio.sleep(0.05)
            leases.touch("busy")
        await leases.close()
        return leases

    r = FakeRedis()
    leases = asyncio.run(go(r))
    assert list(leases.held) == ["busy"]
    assert refreshed(r) and all(t == {keys.lease("busy")} for t in refreshed(r)), refreshed(r)


def test_output_streams_read_to_their_end_expire_with_the_next_refresh_not_one_round_trip_each():
    async def go(r: FakeRedis) -> None:
        leases = Leases(ttl_s=0.3, max_idle_s=60, read_out_ttl_s=120)
        place(leases, r, "a")
        leases.expire_later(keys.out_stream("a"))
        leases.expire_later(keys.out_stream("b"))
        leases.release("a")
        assert r.expired == []  # nothing sent yet
        await asyncio.sleep(0.2)  # one refresh turn; the loop then ends (nothing held, nothing to expire)
        assert leases._task is not None and leases._task.done()
        await leases.close()

    r = FakeRedis()
    asyncio.run(go(r))
    assert r.expired == [(keys.out_stream("a"), 120_000, 0), (keys.out_stream("b"), 120_000, 0)]
    assert r.round_trips == [[]]  # both went in that turn's one round trip


def test_the_worker_cancels_a_request_only_once_its_lease_stayed_gone(monkeypatch):
    alive = {"kept"}
    monkeypatch.setattr(streams, "leases_alive", lambda _r, ids, _shard: {i for i in ids if i in alive})
    clock = [100.0]
    monkeypatch.setattr("gpu_worker.serve.lease_watch.time.monotonic", lambda: clock[0])
    watch = LeaseWatch(None, 0, lambda: ["kept", "gone"])
    assert watch.lapsed() == []
    clock[0] += LEASE_CONFIRM_S
    assert watch.lapsed() == ["gone"]
    assert watch.lapsed() == []  # the next check is not due yet


def test_the_worker_cancels_no_request_for_its_lease_while_redis_refuses_writes(monkeypatch):
    """Redis full or unable to persist refuses the gateways' lease SETs as it refuses the worker's flushes: a lease
    that lapses then proves nothing, and the request goes on. Once writes go again, a lease still gone must stay
    gone for a whole LEASE_CONFIRM_S before its request is cancelled."""
    monkeypatch.setattr(streams, "leases_alive", lambda _r, ids, _shard: set())
    clock, refused = [100.0], [True]
    monkeypatch.setattr("gpu_worker.serve.lease_watch.time.monotonic", lambda: clock[0])
    watch = LeaseWatch(None, 0, lambda: ["lapsed"], writes_refused=lambda: refused[0])
    for _ in range(3):
        assert watch.check(["lapsed"]) == []
        clock[0] += LEASE_CONFIRM_S
    refused[0] = False
    assert watch.check(["lapsed"]) == []
    clock[0] += LEASE_CONFIRM_S
    assert watch.check(["lapsed"]) == ["lapsed"]
