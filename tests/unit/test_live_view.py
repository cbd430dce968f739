"""gateway.targets.live_view: a fleet with workers seen before but none live (statuses expired while Redis was
away) is re-read until one re-registers, for up to COMEBACK_HEARTBEATS heartbeats; an empty fleet, a live one
and a scale-to-zero gateway are answered at once. The fleet reads are a stand-in here (one module's unit test);
tests/integration/test_redis_outage.py does the same against a real Redis restart."""

from __future__ import annotations

import asyncio

from gateway import targets
from gateway.state import GatewayState
from gateway.targets import live_view
from shared.fleet_state import FleetView
from shared.messages import WorkerStatus
from shared.settings import Settings

LIVE = WorkerStatus(worker_id="w0", model="m", max_model_len=64, block_size=16, total_blocks=8, free_blocks=8)


class Views:
    """Answers the fleet reads from a list of views (the last one from then on), counting them."""

    def __init__(self, *views: FleetView, live_at: float = float("-inf")):
        self.views, self.reads = list(views), 0
        self.live_at = live_at  # loop time this gateway last saw a live worker (gateway.fleet_view.FleetViews)

    async def get(self, _r: object) -> FleetView:
        self.reads += 1
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


def _state(views: Views, **settings: object) -> GatewayState:
    return GatewayState(settings=Settings(heartbeat_s=0.5, **settings), redis=None, tokenizers=None, views=views)


def _run(state: GatewayState) -> tuple[FleetView, float]:
    async def timed() -> tuple[FleetView, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        view = await live_view(state)
        return view, loop.time() - t0

    return asyncio.run(timed())


def test_known_workers_none_live_waits_for_one_to_come_back():
    dead = FleetView(dead=["w0"])
    views = Views(dead, dead, dead, FleetView(live=[LIVE]))
    view, _ = _run(_state(views))
    assert [w.worker_id for w in view.live] == ["w0"] and views.reads == 4


def test_known_workers_that_never_come_back_are_waited_for_two_heartbeats_then_given_up():
    views = Views(FleetView(dead=["w0"]))
    view, waited = _run(_state(views))
    assert not view.live and view.dead == ["w0"]
    assert waited >= targets.COMEBACK_HEARTBEATS * 0.5
    assert views.reads > 2  # re-read meanwhile, not one sleep


def test_live_empty_and_scale_to_zero_fleets_are_answered_at_once():
    for views, settings in [(Views(FleetView(live=[LIVE], dead=["w1"])), {}),
                            (Views(FleetView()), {}),  # never had a worker (or all left cleanly)
                            (Views(FleetView(dead=["w0"])), {"queue_when_no_workers": True})]:
        _run(_state(views, **settings))
        assert views.reads == 1


def test_workers_seen_live_moments_ago_are_waited_for_though_no_set_lists_them():
    """The workers set gone too (another program's string replaced it and expired while Redis was away): no dead
    member to wait for, but this gateway saw a live worker within status_ttl_s + redis_grace_s."""
    async def go(seen_ago: float) -> tuple[FleetView, int]:
        views = Views(FleetView(), FleetView(), FleetView(live=[LIVE]),
                      live_at=asyncio.get_running_loop().time() - seen_ago)
        view = await live_view(_state(views, status_ttl_s=3.0, redis_grace_s=15.0))
        return view, views.reads

    view, reads = asyncio.run(go(seen_ago=10.0))
    assert [w.worker_id for w in view.live] == ["w0"] and reads == 3
    view, reads = asyncio.run(go(seen_ago=30.0))  # long ago: an empty fleet is answered at once
    assert not view.live and reads == 1


def test_a_view_read_already_for_the_request_is_not_read_again():
    """The services path reads the fleet for the default model; placing it then uses that read, so a fleet
    whose workers all crashed is waited for once (two heartbeats), not twice."""

    class Tokenizers:
        async def get(self, model: str) -> str:
            return f"tok({model})"

    views = Views(FleetView(dead=["w0"]))
    state = _state(views)
    state.tokenizers = Tokenizers()

    async def go() -> tuple[targets.Target, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        target = await targets.target_for(state, "m", FleetView(live=[LIVE]))
        return target, loop.time() - t0

    target, took = asyncio.run(go())
    assert views.reads == 0 and [w.worker_id for w in target.workers] == ["w0"]
    assert target.tokenizer == f"tok({state.settings.model})"
    assert took < 0.5  # not the comeback wait
