"""The router: a pure function of (request size, fleet status, policy, reservations) -> worker id or None.

`reservations[w]` are the blocks gateways routed to worker w that its last status does not show yet (they
live in Redis, so every gateway replica sees the others'). None means: no worker can take it now (the
caller queues it in the shared stream or answers 429).

Policies
  free_blocks   (default) workers whose free blocks, less promised and reserved ones, fit the request plus
                `reserve_blocks`; the one with the most headroom left wins.
  prefix        among the same workers, the lowest cost w * (prompt blocks not cached there) + blocks in
                use there (Dynamo's KV-aware cost), using `prefix_overlap[w]` cached prompt blocks.
  least_loaded  fewest running + waiting (+ reserved) requests; ignores free blocks.
  round_robin   turn by turn; ignores free blocks.
Every policy skips draining workers and workers whose whole cache cannot hold the request; and whatever the
policy, gateway.placement skips a worker that has `worker_queue_bound` requests waiting (the enqueue refuses).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.messages import WorkerStatus

POLICIES = ("free_blocks", "prefix", "least_loaded", "round_robin")


def headroom(w: WorkerStatus, request_blocks: int, reservations: Mapping[str, int]) -> int:
    """Blocks worker w would have free after taking the request (negative: it does not fit now)."""
    return w.available_blocks() - reservations.get(w.worker_id, 0) - request_blocks


def route(
    request_blocks: int,
    fleet: Sequence[WorkerStatus],
    policy: str,
    reservations: Mapping[str, int],
    *,
    reserve_blocks: int = 0,
    turn: int = 0,
    prompt_blocks: int = 0,
    prefix_overlap: Mapping[str, int] | None = None,
    prefill_weight: float = 1.0,
) -> str | None:
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
    able = sorted((w for w in fleet if not w.draining and w.total_blocks >= request_blocks),
                  key=lambda w: w.worker_id)
    if not able:
        return None
    if policy == "round_robin":
        return able[turn % len(able)].worker_id
    if policy == "least_loaded":
        return min(able, key=lambda w: (w.running + w.waiting, -headroom(w, request_blocks, reservations),
                                        w.worker_id)).worker_id
    fits = [w for w in able if headroom(w, request_blocks, reservations) >= reserve_blocks]
    if not fits:
        return None
    if policy == "free_blocks":
        return max(fits, key=lambda w: (headroom(w, request_blocks, reservations), -w.waiting)).worker_id
    overlap = prefix_overlap or {}

    def cost(w: WorkerStatus) -> tuple[float, str]:
        uncached = max(prompt_blocks - overlap.get(w.worker_id, 0), 0)
        in_use = w.total_blocks - headroom(w, 0, reservations)
        return prefill_weight * uncached + in_use, w.worker_id

    return min(fits, key=cost).worker_id


def prefix_overlap(owners: Sequence[str | None]) -> dict[str, int]:
    """worker id -> the prompt's leading blocks last routed there, given the worker each block went to, in order
    (None: none known; shared.streams.aprefix_owners): the run that the first block's worker holds."""
    first = owners[0] if owners else None
    if first is None:
        return {}
    return {first: next((i for i, o in enumerate(owners) if o != first), len(owners))}
