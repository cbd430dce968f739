"""The worker's writer thread: everything the worker writes to Redis, so the engine's step loop never waits
on the network.

In one MULTI per flush, in order: output chunks (XADD + expiry), acks of finished requests (XACK + XDEL,
after their final chunk), hand-backs, and the status (SET with a TTL, plus HDEL of the reservations it now
accounts for). The status goes out when it changes, at most `status_max_hz` times a second, and every
`heartbeat_s` regardless (from this thread, so a long engine step does not make the worker look dead).
A failed flush is retried: nothing queued here is dropped while Redis is away.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from shared import streams
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.settings import Settings

log = logging.getLogger("kvfleet.worker")


@dataclass
class HandBack:
    """Give a request back to the fleet: re-enqueue it on the shared stream and ack the old entry."""

    request: GenerationRequest
    ack: streams.Ack


@dataclass
class _Batch:
    chunks: list[OutputChunk] = field(default_factory=list)
    acks: list[streams.Ack] = field(default_factory=list)
    handbacks: list[HandBack] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)  # request ids whose reservation the status now covers

    def __bool__(self) -> bool:
        return bool(self.chunks or self.acks or self.handbacks or self.taken)


class Outbox:
    def __init__(self, r: streams.Client, settings: Settings, worker_id: str):
        self.r, self.settings, self.worker_id = r, settings, worker_id
        self._q: queue.Queue = queue.Queue()
        self._status: WorkerStatus | None = None  # latest snapshot from the main thread
        self._published: WorkerStatus | None = None
        self._last_pub = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfleet-outbox", daemon=True)
        self.healthy = False  # the last flush reached Redis

    # ---- main thread -------------------------------------------------------------------------
    def start(self) -> Outbox:
        self._thread.start()
        return self

    def send(self, chunks: list[OutputChunk], ack: streams.Ack | None = None) -> None:
        self._q.put(_Batch(chunks=list(chunks), acks=[ack] if ack else []))

    def hand_back(self, request: GenerationRequest, ack: streams.Ack) -> None:
        self._q.put(_Batch(handbacks=[HandBack(request, ack)]))

    def set_status(self, status: WorkerStatus, taken: list[str] | None = None) -> None:
        """The latest snapshot; `taken`: requests now in the engine, whose reservations it covers."""
        self._status = status
        if taken or not status.same_state(self._published):
            self._q.put(_Batch(taken=list(taken or [])))

    def close(self, timeout_s: float = 10.0, *, remove_status: bool = True) -> None:
        """Flush everything queued, then (by default) delete the status so others take over at once."""
        self._stop.set()
        self._q.put(None)
        self._thread.join(timeout_s)
        if remove_status:
            try:
                streams.remove_status(self.r, self.worker_id)
            except streams.RedisError as e:
                log.warning("could not remove status: %s", e)

    # ---- writer thread -----------------------------------------------------------------------
    def _run(self) -> None:
        pending = _Batch()
        while True:
            timeout = max(0.0, self._last_pub + self.settings.heartbeat_s - time.monotonic())
            if self._status is not None and not self._status.same_state(self._published):
                timeout = max(0.0, self._last_pub + 1.0 / self.settings.status_max_hz - time.monotonic())
            try:
                self._merge(pending, self._q.get(timeout=timeout))
                while True:
                    self._merge(pending, self._q.get_nowait())
            except queue.Empty:
                pass
            ok = self._flush(pending)
            if ok:
                pending = _Batch(taken=pending.taken)  # reservations wait for the next status
            if self._stop.is_set() and self._q.empty() and ok:
                return
            if not ok:
                time.sleep(0.2)

    @staticmethod
    def _merge(into: _Batch, item: _Batch | None) -> None:
        if item is None:
            return
        into.chunks += item.chunks
        into.acks += item.acks
        into.handbacks += item.handbacks
        into.taken += item.taken

    def _status_due(self, now: float) -> bool:
        if self._status is None:
            return False
        if now - self._last_pub >= self.settings.heartbeat_s:
            return True
        changed = not self._status.same_state(self._published)
        return changed and now - self._last_pub >= 1.0 / self.settings.status_max_hz

    def _flush(self, batch: _Batch) -> bool:
        """Write the batch (and the status when due). On success the caller keeps only `batch.taken`,
        which this clears when the status that covers it went out."""
        now = time.monotonic()
        status_due = self._status_due(now)
        if not (batch.chunks or batch.acks or batch.handbacks) and not status_due:
            return True
        status = self._status
        if status_due and status is not None:
            status = status.model_copy(update={"heartbeat": time.time()})
        try:
            streams.publish(self.r, self.worker_id, output_ttl_s=self.settings.output_ttl_s, chunks=batch.chunks,
                            requeued=[hb.request for hb in batch.handbacks],
                            acks=batch.acks + [hb.ack for hb in batch.handbacks],
                            status=status if status_due else None, status_ttl_s=self.settings.status_ttl_s,
                            taken=batch.taken)
        except streams.RedisError as e:
            self.healthy = False
            log.warning("redis write failed (%s); retrying", e)
            return False
        self.healthy = True
        if status_due and status is not None:
            self._published, self._last_pub = status, now
            batch.taken = []
        return True
