"""The router: a pure function of (request size, fleet status, policy, reservations) -> worker id or None.

`reservations[w]` are the blocks gateways routed to worker w that its last status does not show yet (they
live in Redis, so every gateway replica sees the others'). None means: no worker can take it now (the
caller queues it in the shared stream or answers 429).

Policies
  free_blocks   (default) workers whose free blocks, less promised and reserved ones, fit the request plus
                `reserve_blocks`; the one with the most headroom left wins.
  prefix        among the same workers, the lowest cost w * (prompt blocks not cached there) + blocks in
                use there (Dynamo's KV-aware cost; w = `prefill_weight`, Settings.prefix_weight), using
                `prefix_overlap[w]` cached prompt blocks (prefix_overlap() below). With `affinity_slack` >= 0
                (Settings.prefix_affinity_slack), only workers with at most that many requests (running +
                waiting) more than the least loaded one compete: a large w cannot pile a popular prefix's
                requests onto one worker. The defaults (16, 32) were chosen in `kvfleet bench fleet-sim`.
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
    affinity_slack: int = -1,
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
    if affinity_slack >= 0:
        least = min(w.running + w.waiting for w in fits)
        fits = [w for w in fits if w.running + w.waiting <= least + affinity_slack]

    def cost(w: WorkerStatus) -> tuple[float, str]:
        uncached = max(prompt_blocks - overlap.get(w.worker_id, 0), 0)
        in_use = w.total_blocks - headroom(w, 0, reservations)
        return prefill_weight * uncached + in_use, w.worker_id

    return min(fits, key=cost).worker_id


def prefix_overlap(owners: Sequence[Sequence[str]]) -> dict[str, int]:
    """worker id -> how many of the prompt's leading blocks it holds, given the workers each block was last
    routed to, in order ([]: none known; shared.streams.aprefix_owners). A block's hash chains every block
    before it, so the request that took block i to worker w took blocks 0..i there too: each worker is credited
    with its deepest block. (A chat's next turn shares its first blocks with every chat on the same system
    prompt, last routed anywhere; its deeper blocks name the workers that hold the conversation. A hot prompt
    that outgrew one worker names each worker it went to.)"""
    overlap: dict[str, int] = {}
    for i, workers in enumerate(owners):
        for w in workers:
            overlap[w] = i + 1
    return overlap
