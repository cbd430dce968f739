"""The fleet as Redis shows it, as plain data: the live workers (their statuses), the dead ones, the blocks
reserved on each; and the snapshot shaped from it (GET /v1/fleet, `kvfleet status` / `top`, the gateway's
fleet gauges). No Redis commands here: shared.streams reads the fleet (aread_fleet, afleet_snapshot) and
fills these in.

A status this version cannot read (a worker of another kvfleet version in a rolling upgrade, a key something
else wrote) leaves that worker out: neither routed to nor taken for dead (its status is there, so it lives).
It is said once per worker and reason, and shown apart (`unreadable`); the rest of the fleet goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from pydantic import ValidationError

from shared import keys
from shared.messages import WorkerStatus

log = logging.getLogger("kvfleet.fleet")
_said: set[tuple[str, str]] = set()  # (worker, reason) of the unreadable statuses logged by this process


class UnreadableStatus(ValueError):
    """A worker's status that this version cannot read; the message says why."""


def parse_status(worker_id: str, raw: str) -> WorkerStatus:
    """The status `worker_id` published; UnreadableStatus (logged once per worker and reason) when it is not one
    this version reads."""
    try:
        return WorkerStatus.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors()
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"]) or "the value"
        reason = f"{where}: {first['msg']}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
    raise unreadable(worker_id, reason)


NOT_A_STRING = "its key is not a string (WRONGTYPE)"  # the reason for a status kept in another Redis type


def unreadable(worker_id: str, reason: str) -> UnreadableStatus:
    """The error for a status this version cannot read (its key of another type, too), logged once per worker and
    reason."""
    if (worker_id, reason) not in _said:
        _said.add((worker_id, reason))
        log.warning("the status of worker %s cannot be read (%s): left out of the fleet, neither routed to nor taken "
                    "for dead. Is it a worker of another kvfleet version?", worker_id, reason)
    return UnreadableStatus(reason)


@dataclass
class FleetView:
    """What routing reads on each request: workers whose status is present (live), workers that were seen
    but whose status expired (dead), and per live worker the blocks gateways reserved there that its status
    does not show yet."""

    live: list[WorkerStatus] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # worker -> why its status cannot be read
    reservations: dict[str, int] = field(default_factory=dict)  # worker -> reserved blocks
    shards: dict[str, int] = field(default_factory=dict)  # worker (live or dead) -> its shard
    in_use: list[int] = field(default_factory=lambda: [0])  # the shards workers ever lived in

    def serving(self, model_matches: Callable[[WorkerStatus], bool]) -> list[WorkerStatus]:
        return [w for w in self.live if model_matches(w)]


class StreamInfo(TypedDict):
    length: int  # entries: queued and in work
    pending: int  # delivered to a worker, not yet acked


class FleetSnapshot(TypedDict):
    """The fleet at a glance, as JSON (GET /v1/fleet prints it as is)."""

    workers: list[dict[str, Any]]  # each live worker's WorkerStatus, plus heartbeat_age_s and reserved_blocks
    dead_workers: list[str]
    unreadable_workers: dict[str, str]  # worker -> why its status cannot be read (left out of the fleet)
    streams: dict[str, StreamInfo]  # request stream -> its counts
    dead_letters: int  # entries in the dead-letter stream
    # Redis's state: used_memory, maxmemory (0: no cap) and maxmemory_policy (INFO memory), persistence_error (""
    # when its persistence works: INFO persistence); None on a cluster
    redis: dict[str, Any] | None
    # fleet sets holding another Redis type (another program's write), read around: each named, with what to do
    keys_of_another_type: list[str]


def lag(info: StreamInfo) -> int:
    """Entries no worker has taken yet."""
    return max(0, info["length"] - info["pending"])


def snapshot_streams(view: FleetView) -> list[str]:
    """The request streams a snapshot counts: each shard's shared one, then each live and each dead worker's."""
    return ([keys.req_any(k) for k in view.in_use]
            + [keys.req_stream(w, view.shards.get(w, 0)) for w in [s.worker_id for s in view.live] + view.dead])


def snapshot(view: FleetView, streams: dict[str, StreamInfo], dead_letters: int, now: float,
             redis_state: dict[str, Any] | None = None, of_another_type: list[str] | None = None) -> FleetSnapshot:
    return {
        "workers": [s.model_dump() | {"heartbeat_age_s": round(now - s.heartbeat, 3),
                                      "reserved_blocks": view.reservations.get(s.worker_id, 0)}
                    for s in view.live],
        "dead_workers": view.dead,
        "unreadable_workers": view.unreadable,
        "streams": streams,
        "dead_letters": dead_letters,
        "redis": redis_state,
        "keys_of_another_type": of_another_type or [],
    }
