"""gateway.fleet_view alone, with the Redis read replaced by a counting stand-in: concurrent requests share one
read, a view younger than max_age_s is reused, the gateway's own reservations count until the next read, and
a failed read is not cached."""

from __future__ import annotations

import asyncio

import pytest

from gateway import fleet_view
from gateway.fleet_view import FleetViews
from shared.fleet_state import FleetView

pytestmark = pytest.mark.unit

SHARD_READS: list[float] = []


@pytest.fixture(autouse=True)
def one_shard(monkeypatch):
    async def shards(_r) -> list[int]:
        SHARD_READS.append(asyncio.get_running_loop().time())
        return [0]

    SHARD_READS.clear()
    monkeypatch.setattr(fleet_view.streams, "aread_shards", shards)


class Reads:
    def __init__(self, fail: int = 0):
        self.count, self.fail = 0, fail

    async def __call__(self, _r, in_use=None) -> FleetView:
        assert in_use == [0]  # the shards, read by the views at most every SHARDS_EVERY_S
        self.count += 1
        await asyncio.sleep(0.01)
        if self.fail:
            self.fail -= 1
            raise ConnectionError("Redis away")
        return FleetView(reservations={"w0": self.count})


def test_concurrent_requests_share_one_read_and_a_young_view_is_reused(monkeypatch):
    reads = Reads()
    monkeypatch.setattr(fleet_view.streams, "aread_fleet", reads)

    async def go() -> list:
        views = FleetViews(max_age_s=0.2)
        first = await asyncio.gather(*[views.get(None) for _ in range(10)])
        again = await views.get(None)
        await asyncio.sleep(0.25)
        later = await views.get(None)
        return [first, again, later]

    first, again, later = asyncio.run(go())
    assert reads.count == 2
    assert all(v is first[0] for v in first) and again is first[0]
    assert later.reservations == {"w0": 2}


def test_own_reservations_count_until_the_next_read(monkeypatch):
    reads = Reads()
    monkeypatch.setattr(fleet_view.streams, "aread_fleet", reads)

    async def go() -> tuple:
        views = FleetViews(max_age_s=0.1)
        await views.get(None)
        views.reserved("w0", 5)
        views.reserved("w1", 3)
        mine = (await views.get(None)).reservations
        await asyncio.sleep(0.15)
        return mine, (await views.get(None)).reservations

    mine, fresh = asyncio.run(go())
    assert mine == {"w0": 1 + 5, "w1": 3}
    assert fresh == {"w0": 2}  # what Redis holds now (it counts the reservations itself)


def test_a_failed_read_is_not_cached(monkeypatch):
    reads = Reads(fail=1)
    monkeypatch.setattr(fleet_view.streams, "aread_fleet", reads)

    async def go() -> FleetView:
        views = FleetViews(max_age_s=10)
        with pytest.raises(ConnectionError):
            await views.get(None)
        return await views.get(None)

    assert asyncio.run(go()).reservations == {"w0": 2}


def test_the_shards_are_read_once_a_second_not_with_every_view(monkeypatch):
    monkeypatch.setattr(fleet_view.streams, "aread_fleet", Reads())

    async def go() -> None:
        views = FleetViews(max_age_s=0.0)
        for _ in range(5):
            await views.get(None)

    asyncio.run(go())
    assert len(SHARD_READS) == 1


def test_the_reservations_expiry_is_due_once_per_third_of_its_ttl_per_worker():
    async def go() -> list[bool]:
        views, seen = FleetViews(max_age_s=0.2), []
        seen.append(views.expiry_due("w0", 0, ttl_s=0.3))  # never pushed
        views.reserved("w0", 4, shard=0, expiry_pushed=True)
        seen.append(views.expiry_due("w0", 0, ttl_s=0.3))  # just pushed
        seen.append(views.expiry_due("w1", 0, ttl_s=0.3))  # another worker's hash
        views.reserved("w0", 4, shard=0)  # an enqueue that did not push
        await asyncio.sleep(0.12)
        seen.append(views.expiry_due("w0", 0, ttl_s=0.3))  # a third of the TTL later
        return seen

    assert asyncio.run(go()) == [True, False, True, True]
