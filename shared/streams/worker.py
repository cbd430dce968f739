"""The worker side: its consumer-group reads, takeover of what dead workers left pending, dead letters and
cancels (gpu_worker.serve.intake), and one MULTI per flush of chunks, hand-backs, acks and status
(gpu_worker.serve.outbox)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from shared.messages import DeadLetter, GenerationRequest, OutputChunk, WorkerStatus
from shared.streams.output import add_chunk_commands
from shared.streams.requests import enqueue_commands

# ---- worker side: intake --------------------------------------------------------------------------
# The worker's reader threads (gpu_worker.serve.intake): its consumer-group reads, the takeover of what dead
# workers left pending, dead letters, cancels.

DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True)
class Ack:
    """A request-stream entry to acknowledge: XACK in the workers' group, then XDEL."""

    stream: str
    entry_id: str


@dataclass(frozen=True)
class Delivery:
    """One request-stream entry as this consumer received it. `fields` is None when the entry was deleted
    after it was delivered; `deliveries` counts this delivery too."""

    stream: str
    entry_id: str
    fields: dict[str, str] | None
    deliveries: int = 1

    @property
    def ack(self) -> Ack:
        return Ack(self.stream, self.entry_id)


def ensure_group(r: redis.Redis, stream: str) -> None:
    """Create the workers' consumer group on `stream` (and the stream), unless it exists."""
    try:
        r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def read_requests(r: redis.Redis, consumer: str, want: dict[str, str], *, count: int,
                  block_ms: int | None = None) -> list[Delivery]:
    """XREADGROUP as `consumer` from each stream in `want` (stream -> id, ">" for new entries)."""
    reply = r.xreadgroup(keys.GROUP, consumer, want, count=count, block=block_ms)
    return [Delivery(stream, entry_id, fields) for stream, entries in reply or [] for entry_id, fields in entries]


def shared_head(r: redis.Redis) -> dict[str, str] | None:
    """The fields of the oldest entry of kvfleet:req:any that no worker has taken yet (None: none waits)."""
    groups = {g["name"]: g for g in r.xinfo_groups(keys.REQ_ANY)}
    last = groups.get(keys.GROUP, {}).get("last-delivered-id", "0-0")
    head = r.xrange(keys.REQ_ANY, min=f"({last}", max="+", count=1)
    return head[0][1] if head else None


def claim_pending(r: redis.Redis, stream: str, owner: str, consumer: str, *, min_idle_ms: int,
                  count: int) -> list[Delivery]:
    """Move to `consumer` up to `count` entries `owner` left pending on `stream`: XPENDING for that one
    consumer, then XCLAIM with `min_idle_ms`, so of two claimers only one gets each entry (XAUTOCLAIM by idle
    time alone would also take a live worker's long request). [] when the stream or group does not exist."""
    try:
        pending = r.xpending_range(stream, keys.GROUP, min="-", max="+", count=count, consumername=owner)
    except redis.ResponseError:
        return []
    if not pending:
        return []
    counts = {p["message_id"]: p["times_delivered"] for p in pending}
    claimed = r.xclaim(stream, keys.GROUP, consumer, min_idle_ms, list(counts))
    return [Delivery(stream, entry_id, fields or None, counts[entry_id] + 1) for entry_id, fields in claimed]


def other_workers(r: redis.Redis, worker_id: str) -> dict[str, WorkerStatus | None]:
    """Every other worker ever seen (kvfleet:workers), by id, with its status: None when the status expired
    (the worker is dead)."""
    members = sorted(r.smembers(keys.WORKERS) - {worker_id})
    raw = r.mget([keys.status(w) for w in members]) if members else []
    return {w: None if s is None else WorkerStatus.model_validate_json(s) for w, s in zip(members, raw, strict=True)}


def prune_dead_worker(r: redis.Redis, dead: str) -> bool:
    """Forget a dead worker that left nothing behind (its own stream empty, nothing of kvfleet:req:any
    pending on it): delete its stream and reservations, drop it from kvfleet:workers and from the shared
    stream's group, in one MULTI. False: it still has requests to take over."""
    if r.xlen(keys.req_stream(dead)) or r.xpending_range(keys.REQ_ANY, keys.GROUP, "-", "+", 1, consumername=dead):
        return False
    pipe = r.pipeline(transaction=True)
    pipe.delete(keys.req_stream(dead), keys.reserved(dead))
    pipe.srem(keys.WORKERS, dead)
    pipe.xgroup_delconsumer(keys.REQ_ANY, keys.GROUP, dead)
    pipe.execute()
    return True


def is_cancelled(r: redis.Redis, request_id: str) -> bool:
    """A cancel for the request was written (the marker outlives the kvfleet:cancel entry a reader missed)."""
    return bool(r.exists(keys.cancelled(request_id)))


def ack_commands(pipe: Any, ack: Ack) -> None:
    pipe.xack(ack.stream, keys.GROUP, ack.entry_id)
    pipe.xdel(ack.stream, ack.entry_id)


def ack_and_delete(r: redis.Redis, ack: Ack) -> None:
    """XACK and XDEL the entry, in one MULTI."""
    pipe = r.pipeline(transaction=True)
    ack_commands(pipe, ack)
    pipe.execute()


def forward(r: redis.Redis, request: GenerationRequest, worker_id: str, ack: Ack) -> None:
    """Enqueue the request on another worker (reserving its blocks there) and ack this entry, in one MULTI."""
    pipe = r.pipeline(transaction=True)
    enqueue_commands(pipe, request, worker_id)
    ack_commands(pipe, ack)
    pipe.execute()


def dead_letter(r: redis.Redis, letter: DeadLetter) -> None:
    """Append to kvfleet:dead (capped, approximately, at DEAD_LETTER_MAXLEN)."""
    r.xadd(keys.DEAD, {keys.FIELD: letter.model_dump_json()}, maxlen=DEAD_LETTER_MAXLEN, approximate=True)


def cancel_cursor(r: redis.Redis) -> str:
    """Where a new reader of kvfleet:cancel starts: after the last cancel written so far."""
    return r.xinfo_stream(keys.CANCEL)["last-generated-id"] if r.exists(keys.CANCEL) else "0-0"


def read_cancels(r: redis.Redis, after: str, *, block_ms: int = 1000, count: int = 256) -> tuple[str, list[str]]:
    """The request ids cancelled after entry `after` (waiting up to block_ms for one), and the new cursor."""
    ids = []
    for _stream, entries in r.xread({keys.CANCEL: after}, block=block_ms, count=count) or []:
        for entry_id, fields in entries:
            after = entry_id
            ids.append(fields[keys.FIELD])
    return after, ids


# ---- worker side: outbox --------------------------------------------------------------------------
# The worker's writer thread (gpu_worker.serve.outbox): everything it writes goes in one MULTI per flush.

def publish(r: redis.Redis, worker_id: str, *, output_ttl_s: float, chunks: Sequence[OutputChunk] = (),
            requeued: Sequence[GenerationRequest] = (), acks: Sequence[Ack] = (),
            status: WorkerStatus | None = None, status_ttl_s: float = 0.0, taken: Sequence[str] = ()) -> None:
    """One MULTI, in this order: the output chunks (XADD + expiry), the hand-backs (XADD to kvfleet:req:any),
    the acks (XACK + XDEL, so an entry is acked only with or after the chunks before it), and with `status`
    its SET with a TTL of status_ttl_s, the worker's SADD to kvfleet:workers and the HDEL of the
    reservations of the `taken` requests, which that status now counts."""
    pipe = r.pipeline(transaction=True)
    for chunk in chunks:
        add_chunk_commands(pipe, chunk, output_ttl_s)
    for request in requeued:
        enqueue_commands(pipe, request, None)
    for ack in acks:
        ack_commands(pipe, ack)
    if status is not None:
        pipe.set(keys.status(worker_id), status.model_dump_json(), px=int(status_ttl_s * 1000))
        pipe.sadd(keys.WORKERS, worker_id)
        if taken:
            pipe.hdel(keys.reserved(worker_id), *taken)
    pipe.execute()


def remove_status(r: redis.Redis, worker_id: str) -> None:
    """Delete the worker's status: to the others it is dead at once, and they take over what it left."""
    r.delete(keys.status(worker_id))
