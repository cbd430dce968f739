"""Which workers a request for a model goes to (its Target): the live workers that serve it, its tokenizer, and the
limits the request is checked against. 503 no_workers when none lives (naming those that stopped reporting), 404
for a model the fleet does not serve; with none alive and queue_when_no_workers (scale to zero), or with Redis away,
the gateway's own model and tokenizer. After an outage the fleet view waits a moment for the workers it saw to
re-register (live_view)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError
from gateway.fleet_view import read_view
from gateway.state import GatewayState
from gateway.tokenizer import same_model
from shared import streams
from shared.fleet_state import FleetView
from shared.messages import WorkerStatus

COMEBACK_HEARTBEATS = 2  # how long a fleet with known workers but none live is waited for (live_view)
COMEBACK_POLL_S = 0.05


@dataclass
class Target:
    model: str  # the name answered back to the client
    workers: list[WorkerStatus]
    view: FleetView
    tokenizer: Any
    max_model_len: int
    block_size: int
    max_total_blocks: int
    # Redis was away when the fleet was read: the request is checked against the gateway's own model (its tokenizer
    # is here), then this is raised (a 503) where it would be placed. Bad input stays a 4xx during an outage.
    outage: Exception | None = None


async def target_for(state: GatewayState, model: str, view: FleetView | None = None) -> Target:
    """The live workers serving `model` and its tokenizer; 503 when none lives, 404 for an unknown model.
    `view`: the fleet as live_view read it for this request already (else it is read here)."""
    settings = state.settings
    try:
        view = view if view is not None else await live_view(state)
    except streams.RedisError as e:
        if isinstance(e, streams.KeyOfAnotherType) or not same_model(model, settings.model, ""):
            raise  # a key of another type is no outage: the 503 names it
        return await _own_model(state, model, FleetView(), outage=e)
    if not view.live and not settings.queue_when_no_workers:
        silent = f"; {len(view.dead)} stopped reporting their status ({', '.join(view.dead[:5])}): they are down, " \
                 "or cannot write to Redis (`kvfleet status` shows Redis's state)" if view.dead else ""
        if view.unreadable:  # another version's status, or one kept in another Redis type
            silent += f"; {len(view.unreadable)} report a status this gateway cannot read (" + ", ".join(
                f"{w}: {why}" for w, why in sorted(view.unreadable.items())[:5]) + ")"
        raise APIError(503, f"no worker is alive to serve requests{silent}; start one with `kvfleet worker`",
                       code="no_workers", headers={"Retry-After": str(settings.retry_after_s)})
    workers = view.serving(lambda w: same_model(model, w.model, w.model_path))
    if not workers and view.live:
        served = sorted({w.model for w in view.live})
        raise APIError(404, f"the model {model!r} does not exist; this fleet serves: {', '.join(served)}",
                       param="model", code="model_not_found")
    if not workers:  # scale to zero: queue for the gateway's own model
        if not same_model(model, settings.model, ""):
            raise APIError(404, f"the model {model!r} does not exist; this gateway serves {settings.model!r}",
                           param="model", code="model_not_found")
        return await _own_model(state, model, view)
    tok = await state.tokenizers.get(workers[0].model_path or settings.model)
    return Target(model=model, workers=workers, view=view, tokenizer=tok,
                  max_model_len=min(w.max_model_len for w in workers), block_size=workers[0].block_size,
                  max_total_blocks=max(w.total_blocks for w in workers))


async def live_view(state: GatewayState) -> FleetView:
    """The fleet view. When workers were seen but none is live, their statuses may have expired while Redis was
    away (stopped or restarted for longer than status_ttl_s), and each re-registers within a heartbeat of its
    return: the fleet is re-read for up to COMEBACK_HEARTBEATS heartbeats before it is taken as empty (a 503
    no_workers comes that much later when all workers crashed; workers that stopped cleanly left the fleet,
    streams.leave, and do not hold them up unless this gateway saw them live moments before). Seen: in the workers
    set with no status (dead), or live in this gateway's reads within status_ttl_s + redis_grace_s: the set itself
    may be gone too (another program's write replaced it and expired; chaos seed 227: Redis paused 10.6 s right
    after, and the first requests after its return got 503 no_workers from a fleet of three live workers). Not with
    queue_when_no_workers: requests then queue at once."""
    view = await read_view(state.views, state.redis)
    if view.live or state.settings.queue_when_no_workers:
        return view
    settings, loop = state.settings, asyncio.get_running_loop()
    recently_live = (state.views is not None
                     and loop.time() - state.views.live_at < settings.status_ttl_s + settings.redis_grace_s)
    if not view.dead and not recently_live:
        return view
    deadline = loop.time() + COMEBACK_HEARTBEATS * settings.heartbeat_s
    while not view.live and loop.time() < deadline:
        await asyncio.sleep(COMEBACK_POLL_S)
        view = await read_view(state.views, state.redis)
    return view


async def _own_model(state: GatewayState, model: str, view: FleetView, outage: Exception | None = None) -> Target:
    """No worker to size the request by (none alive: scale to zero; or Redis away): the gateway's own model, its
    tokenizer, and no window or cache limit (the worker that takes it checks those)."""
    tok = await state.tokenizers.get(state.settings.model)
    return Target(model, [], view, tok, max_model_len=0, block_size=16, max_total_blocks=1 << 30, outage=outage)
