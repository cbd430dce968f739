"""The worker's writer thread: everything the worker writes to Redis, so the engine's step loop never waits
on the network.

In one atomic script per flush (streams.publish), in order: output chunks (one XADD per gateway inbox with
all of this flush's chunks for that gateway's requests; XADD + expiry to a request's own stream for the
others), hand-backs, acks of finished requests (XACK + XDEL, after their final chunk), and the status (SET with
a TTL, plus HDEL of the reservations it now accounts for). Every write for a request is fenced: made only
while this worker still owns the request's stream entry (its owner token: consumer and delivery count; the
status of this run, `run_id`, vouches for all of them between acks). Writes for a request another
worker took over (this one was paused or cut off past the status TTL) are refused; its id comes out of
`lost`, and the main thread aborts it. The status goes out when it changes, at most `status_max_hz` times a second
(while the engine steps, with the next step's chunks when they come within another period), and every
`heartbeat_s` regardless (from this thread, so a long engine step does not make the worker look dead).
A failed flush is retried: nothing queued here is dropped while Redis is away, or full (at its maxmemory under
noeviction, it refuses the flush's writes: the status is then kept alive with PEXPIRE, which it still takes, so
the fleet does not take this worker for dead), or unable to persist (MISCONF: a full disk; it then refuses every
write, PEXPIRE too, so the status expires until Redis takes writes again). Dead letters (requests the
engine failed) go to kvfleet:dead just before the flush that carries their final chunk and ack. The thread
survives any error: one that is not Redis's is logged with its traceback and the batch is written piece by
piece, dropping (and logging) only what cannot be written at all; `alive` tells the worker it still runs.
The main thread hands over one engine step's writes as one item (`gathered()`): one step, one flush.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from shared import streams
from shared.messages import DeadLetter, GenerationRequest, OutputChunk, WorkerStatus
from shared.outage_log import OutageLog
from shared.settings import Settings

log = logging.getLogger("kvfleet.worker")

REFUSED_SAY_S = 30.0  # while Redis refuses writes, say so this often at most (each flush is retried every 0.2 s)


@dataclass
class HandBack:
    """Give a request back to the fleet: re-enqueue it on the shared stream and ack the old entry."""

    request: GenerationRequest
    ack: streams.Ack


@dataclass
class _Batch:
    chunks: list[OutputChunk] = field(default_factory=list)
    owners: dict[str, streams.Ack] = field(default_factory=dict)  # request id -> the delivery its chunks need
    reply_to: dict[str, str] = field(default_factory=dict)  # request id -> the gateway whose inbox its chunks go to
    acks: list[streams.Ack] = field(default_factory=list)
    handbacks: list[HandBack] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)  # request ids whose reservation the status now covers
    dead_letters: list[DeadLetter] = field(default_factory=list)


class Outbox:
    def __init__(self, r: streams.Client, settings: Settings, worker_id: str, run_id: str = "",
                 held: Callable[[], dict[str, streams.Ack]] | None = None):
        self.r, self.settings, self.worker_id = r, settings, worker_id
        self.held = held or dict  # request id -> delivery, of every request the worker holds (from any thread)
        self.run_id = run_id or uuid.uuid4().hex  # in every status this run publishes: the flushes' fence
        self._q: queue.Queue = queue.Queue()
        self._status: WorkerStatus | None = None  # latest snapshot from the main thread
        self._published: WorkerStatus | None = None
        self._last_pub = 0.0
        self._last_chunks = float("-inf")  # when a flush last carried chunks (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfleet-outbox", daemon=True)
        self.healthy = False  # the last flush reached Redis
        # why Redis refused the last flush's writes (streams.write_refused: "full", "cannot persist"; "" when it
        # took them)
        self.refused = ""
        self._refused_said = float("-inf")  # when that was last logged
        self._outage = OutageLog(log, "redis write")  # its other failures (Redis away), said once per outage
        # (request id, delivery) of the requests another worker owns now (fenced out)
        self.lost: queue.SimpleQueue[tuple[str, streams.Ack]] = queue.SimpleQueue()
        self.fenced_out: set[streams.Ack] = set()  # the deliveries whose writes were refused: never written again
        self._gathering: list[_Batch] | None = None  # the main thread's writes inside `gathered()`, not queued yet

    # ---- main thread -------------------------------------------------------------------------
    def start(self) -> Outbox:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The writer thread runs (or was never started, or was closed)."""
        return self._thread.ident is None or self._thread.is_alive() or self._stop.is_set()

    @contextlib.contextmanager
    def gathered(self):
        """Everything sent inside goes to the writer thread as one item, so one engine step's output goes out in one
        flush. Queued one request at a time, the writer woke at the first and flushed while the step's other requests
        were still being queued: 1.7 flushes per step with 128 requests in flight (simulated 200 ms steps)."""
        self._gathering = []
        try:
            yield
        finally:
            items, self._gathering = self._gathering, None
            if items:
                batch = _Batch()
                for item in items:
                    self._merge(batch, item)
                self._q.put(batch)

    def _put(self, batch: _Batch) -> None:
        if self._gathering is None:
            self._q.put(batch)
        else:
            self._gathering.append(batch)

    def send(self, chunks: list[OutputChunk], ack: streams.Ack | None = None,
             dead_letter: DeadLetter | None = None, *, owner: streams.Ack | None = None,
             reply_to: str | None = None) -> None:
        """Write `chunks` (into the `reply_to` gateway's inbox, else their request's own stream) under `owner`
        (default: `ack`, the delivery they finish), then the ack. Writes for a delivery this worker no longer owns are
        refused; its request id then comes out of `lost`."""
        owner = owner or ack
        owners = {c.request_id: owner for c in chunks} if owner is not None else {}
        self._put(_Batch(chunks=list(chunks), owners=owners, acks=[ack] if ack else [],
                           reply_to={c.request_id: reply_to for c in chunks} if reply_to else {},
                           dead_letters=[dead_letter] if dead_letter else []))

    def hand_back(self, request: GenerationRequest, ack: streams.Ack) -> None:
        self._put(_Batch(handbacks=[HandBack(request, ack)]))

    def set_status(self, status: WorkerStatus, taken: list[str] | None = None) -> None:
        """The latest snapshot; `taken`: requests now in the engine, whose reservations it covers."""
        self._status = status
        if taken or not status.same_state(self._published):
            self._put(_Batch(taken=list(taken or [])))

    def republish(self) -> None:
        """Send the status with the next flush, whatever its schedule (Redis lost it: re-register now)."""
        self._last_pub = float("-inf")
        self._q.put(_Batch())

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush everything queued, then delete the status so others take over at once, and leave the fleet
        when nothing is left to take over (streams.leave)."""
        self._stop.set()
        self._q.put(None)
        self._thread.join(timeout_s)
        try:
            streams.leave(self.r, self.worker_id, self.settings.worker_shard)
        except streams.RedisError as e:
            log.warning("could not remove the status and leave the fleet: %s", e)

    # ---- writer thread -----------------------------------------------------------------------
    def _run(self) -> None:
        pending, failures = _Batch(), 0
        while True:
            try:
                pending, done = self._turn(pending)
                failures = 0
            except Exception:  # noqa: BLE001 (the writer must not die)
                failures += 1
                log.exception("unexpected error in the outbox thread (%d in a row); carrying on", failures)
                time.sleep(min(0.1 * 2 ** (failures - 1), 5.0))
                continue
            if done:
                return

    def _turn(self, pending: _Batch) -> tuple[_Batch, bool]:
        """Gather what was queued and flush it: (what is still to write, whether the thread should end)."""
        now = time.monotonic()
        timeout = max(0.0, self._last_pub + self.settings.heartbeat_s - now)
        if self._status is not None and not self._status.same_state(self._published):
            # Due one period after the last one. While the engine steps (chunks went out within the period), the
            # changed status waits up to a period more for the next step's flush to carry it: sent alone it costs
            # Redis a script call of its own (with 20 ms steps, a third of all flushes were a status alone).
            period = 1.0 / self.settings.status_max_hz
            wait = 2 * period if now - self._last_chunks < period else period
            timeout = min(timeout, max(0.0, self._last_pub + wait - now))
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
            return pending, True
        if not ok:
            time.sleep(0.2)
        return pending, False

    @staticmethod
    def _merge(into: _Batch, item: _Batch | None) -> None:
        if item is None:
            return
        for rid, owner in item.owners.items():
            old = into.owners.get(rid)
            if old is not None and old != owner:
                # A new delivery of the request (this worker lost the old one, claimed it again and resumed it
                # from what Redis holds): what the old delivery left queued here is never written, least of all
                # under the new delivery's owner token, which the fast flush would let through (duplicate chunks).
                into.chunks = [c for c in into.chunks if c.request_id != rid]
        into.chunks += item.chunks
        into.owners.update(item.owners)
        into.reply_to.update(item.reply_to)
        into.acks += item.acks
        into.handbacks += item.handbacks
        into.taken += item.taken
        into.dead_letters += item.dead_letters

    def _status_due(self, now: float) -> bool:
        if self._status is None:
            return False
        if now - self._last_pub >= self.settings.heartbeat_s:
            return True
        changed = not self._status.same_state(self._published)
        return changed and now - self._last_pub >= 1.0 / self.settings.status_max_hz

    def _while_refused(self, why: str, status_due: bool) -> None:
        """Redis refuses every flush: it is full (maxmemory, noeviction: its writes are SETs and XADDs) or cannot
        persist (MISCONF). Say so, every REFUSED_SAY_S at most. When full, keep the status alive as it is (PEXPIRE,
        which a full Redis takes): else it expires, and the fleet takes this live worker for dead (no route to it,
        its requests taken over). A Redis that cannot persist takes no PEXPIRE either."""
        self.refused = why
        now = time.monotonic()
        if now - self._refused_said >= REFUSED_SAY_S:
            self._refused_said = now
            if why == "full":
                log.warning("%s. This worker's output and status wait (retried; it stays in the fleet)", streams.FULL)
            else:
                log.warning("%s. This worker's output and status wait (retried); its status expires meanwhile, so "
                            "the fleet takes it for dead until Redis takes writes again", streams.CANNOT_PERSIST)
        if status_due and why == "full":
            try:
                if streams.keep_status(self.r, self.worker_id, self.settings.status_ttl_s, self.settings.worker_shard):
                    self._last_pub = now
            except streams.RedisError as e:
                log.warning("could not keep the status alive while Redis is full: %s", e)

    def _flush(self, batch: _Batch) -> bool:
        """Write the batch (and the status when due). On success the caller keeps only `batch.taken`,
        which this clears when the status that covers it went out."""
        now = time.monotonic()
        status_due = self._status_due(now)
        if not (batch.chunks or batch.acks or batch.handbacks or batch.dead_letters) and not status_due:
            return True
        status = self._status
        if status_due and status is not None:
            status = status.model_copy(update={"heartbeat": time.time()})
        try:
            while batch.dead_letters:  # before the final chunk and the ack: a retry does not write them twice
                streams.dead_letter(self.r, batch.dead_letters[0])
                batch.dead_letters.pop(0)
            self._publish(batch, status if status_due else None)
        except streams.RedisError as e:
            self.healthy = False
            if why := streams.write_refused(e):
                self._while_refused(why, status_due)
            else:
                self._outage.failed(e)
            return False
        self._outage.ok()
        if self.refused:
            log.warning("Redis takes writes again: this worker's output goes out")
            self.refused, self._refused_said = "", float("-inf")
        self.healthy = True
        if batch.chunks:
            self._last_chunks = now
        if status_due and status is not None:
            self._published, self._last_pub = status, now
            batch.taken = []
        return True

    def _publish(self, batch: _Batch, status: WorkerStatus | None) -> None:
        """One script (streams.publish); if it fails with an error that is not Redis's (something in the batch cannot be
        written), each chunk alone, dropping only those that cannot be written, then the rest."""
        publish = functools.partial(streams.publish, self.r, self.worker_id, output_ttl_s=self.settings.output_ttl_s,
                                    status_ttl_s=self.settings.status_ttl_s, run_id=self.run_id,
                                    shard=self.settings.worker_shard)
        self._drop_fenced_out(batch)
        held = self.held() if status is not None else {}
        rest = dict(requeued=[(hb.request, hb.ack) for hb in batch.handbacks], status=status, taken=batch.taken,
                    acks=batch.acks, owners=batch.owners, reply_to=batch.reply_to, held=list(held.values()))
        try:
            self._refused(batch, publish(chunks=batch.chunks, **rest), held)
            return
        except streams.RedisError:
            raise
        except Exception:  # noqa: BLE001
            log.exception("writing %d chunk(s) failed; writing them one by one", len(batch.chunks))
        for chunk in batch.chunks:
            try:
                self._refused(batch, publish(chunks=[chunk], owners=batch.owners, reply_to=batch.reply_to))
            except streams.RedisError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("dropping output chunk %d of %s: it cannot be written", chunk.seq, chunk.request_id)
        batch.chunks = []  # written or dropped: a retry of the rest must not write them again
        self._refused(batch, publish(**rest), held)

    def _drop_fenced_out(self, batch: _Batch) -> None:
        """Drop what is queued under a delivery that was refused before: the status this run wrote since vouches
        for the deliveries it holds, not for those it lost (the main thread aborts them, a step or so later)."""
        if not self.fenced_out:
            return
        out = self.fenced_out
        batch.chunks = [c for c in batch.chunks if batch.owners.get(c.request_id) not in out]
        batch.acks = [a for a in batch.acks if a not in out]
        batch.handbacks = [hb for hb in batch.handbacks if hb.ack not in out]

    def _refused(self, batch: _Batch, refused: list[streams.Ack] | None,
                 held: dict[str, streams.Ack] | None = None) -> None:
        """Tell the main thread which requests it lost to another worker (their writes were refused)."""
        lost = set(refused or ())
        if not lost:
            return
        self.fenced_out |= lost
        named = {owner: rid for rid, owner in [*batch.owners.items(), *(held or {}).items()] if owner in lost}
        named |= {hb.ack: hb.request.request_id for hb in batch.handbacks if hb.ack in lost}
        for owner in sorted(lost, key=lambda a: (a.stream, a.entry_id)):
            rid = named.get(owner, f"(entry {owner.entry_id} of {owner.stream})")
            log.warning("request %s is owned by another worker now: its writes here were refused", rid)
            self.lost.put((rid, owner))
