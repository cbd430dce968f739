"""What a kvfleet gateway's `GET /v1/fleet` says about a `kvfleet bench serve` run: per worker, the requests
it finished, the tokens it generated and its preemptions (after minus before), and the peak queue lag (entries
no worker has taken yet, over all request streams) and peak waiting requests, polled while the run goes.
An endpoint without /v1/fleet (vLLM) gives None, quietly."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from services.bench.load_gen import Endpoint

POLL_S = 1.0
SETTLE_S = 0.6  # workers refresh generation_tokens every ~0.5 s: wait for the last refresh


async def fleet_snapshot(client: httpx.AsyncClient, ep: Endpoint) -> dict[str, Any] | None:
    """The fleet snapshot, or None when the endpoint has none (404, not JSON, not a kvfleet snapshot)."""
    try:
        resp = await client.get("/v1/fleet", headers=ep.headers())
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) and "workers" in body and "streams" in body else None


def queue_lag(snapshot: dict[str, Any]) -> int:
    """Entries of every request stream that no worker has taken yet."""
    return sum(max(0, s.get("length", 0) - s.get("pending", 0)) for s in snapshot["streams"].values())


class FleetWatch:
    """`async with FleetWatch(ep) as w:` around a run; then `w.report()` (None without /v1/fleet)."""

    def __init__(self, ep: Endpoint, *, poll: bool = True):
        """`poll`: read /v1/fleet every POLL_S during the run too (queue lag, waiting); else only before and
        after it (the reads cost Redis commands, which `--redis-stats` must not count)."""
        self.ep, self.poll = ep, poll
        self.before: dict[str, Any] | None = None
        self.after: dict[str, Any] | None = None
        self.max_lag = 0
        self.max_waiting = 0
        self._client = httpx.AsyncClient(base_url=ep.url, timeout=5.0)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> FleetWatch:
        self.before = await fleet_snapshot(self._client, self.ep)
        if self.before is not None and self.poll:
            self._task = asyncio.get_running_loop().create_task(self._poll())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.before is not None:
            await asyncio.sleep(SETTLE_S)
            self.after = await fleet_snapshot(self._client, self.ep)
            if self.after is not None:
                self._note(self.after)
        await self._client.aclose()

    def _note(self, snap: dict[str, Any]) -> None:
        self.max_lag = max(self.max_lag, queue_lag(snap))
        self.max_waiting = max(self.max_waiting, sum(w.get("waiting", 0) for w in snap["workers"]))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            snap = await fleet_snapshot(self._client, self.ep)
            if snap is not None:
                self._note(snap)

    def report(self) -> dict[str, Any] | None:
        if self.before is None or self.after is None:
            return None
        before = {w["worker_id"]: w for w in self.before["workers"]}
        workers = {}
        for w in self.after["workers"]:
            b = before.get(w["worker_id"], {})
            workers[w["worker_id"]] = {
                "requests": w.get("num_finished", 0) - b.get("num_finished", 0),
                "generation_tokens": w.get("generation_tokens", 0) - b.get("generation_tokens", 0),
                "preemptions": w.get("num_preemptions", 0) - b.get("num_preemptions", 0),
                "restarts": w.get("restarts", 0) - b.get("restarts", 0),
            }
        peaks = self.poll  # without polling, only the snapshots after the run: no peaks
        return {"workers": workers, "max_queue_lag": self.max_lag if peaks else None,
                "max_waiting": self.max_waiting if peaks else None,
                "dead_workers": self.after.get("dead_workers", []),
                "dead_letters": self.after.get("dead_letters", 0) - self.before.get("dead_letters", 0)}
