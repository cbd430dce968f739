"""The worker's reader threads: requests in, cancels in. They hand Jobs and cancel ids to the main thread
through one queue, so the engine's step loop never blocks on Redis.

Requests come from, in order of preference:
  1. entries this worker id left pending before a restart (all of them, on every stream of the shard, claimed
     back at start, page by page);
  2. what dead workers (status expired) left pending, checked every heartbeat whether or not this worker has
     room (room is needed to run, not to claim: the engine queues them like new work), but only once this
     worker has been on Redis for a status TTL without a break (a failed call, or a reader's turn that took a
     TTL, less its grammar compiles: Redis paused, say): statuses expire while Redis is away (stopped,
     restarted from its AOF, paused) as they do when their worker dies, and a live worker re-registers within
     a heartbeat of Redis's return, so until then a missing status proves nothing. One XPENDING summary of
     every stream of the shard (its own, the shared one, and the streams of workers it took for dead: see 3.)
     names who holds entries where; for each dead holder, XPENDING for it there, then XCLAIM with a minimum
     idle time, so two live workers never take the same entry (this, not
     XAUTOCLAIM by idle time alone, because a live worker's long request also looks idle); the output already
     written seeds the Job, so the stream continues where it stopped (a gateway's request, whose output went to
     its gateway's inbox, goes back to that gateway instead, which places it again: EntryCloser.back_to_gateway). Each
     claim bumps the entry's delivery count: the new owner token, which fences the old owner's writes out
     (shared.streams.worker);
  3. its own stream kvfleet:{s}:req:{worker} (the router's choice), and new entries on dead workers' own streams,
     while its backlog is short (as itself: such an entry is then pending on this worker in that stream, where
     1. and 2. find it should this worker die too; the router's reservation there is dropped, as that worker
     may be back already and would never count the request);
  4. when it has room (nothing waiting, free blocks to spare, and everything it took already accounted), the
     oldest untaken requests of the shared stream kvfleet:{s}:req:any, in order, as many as fit its free blocks
     and sequence slots (the first also when it is idle); the rest stay, in order, for a worker with more room.
A read or a claim whose reply was lost with the connection (Redis stopped just after answering) delivered its
entries all the same: the readers' client never sends a command twice (streams.NO_RESEND), and the turn after a
failed one claims back what is pending on this worker but was never taken (_claim_own).
Every entry read or claimed is judged by gpu_worker.serve.admission before the main thread sees it: handed over
as a Job, or closed here (malformed, delivered too often, cancelled, too large for this worker, a gateway's to
place again), so that no entry can block the stream. The threads survive any error: logged with its traceback,
retried after a backoff; `dead_threads()` lets the worker notice one that died anyway.

The cancel thread reads the fleet's cancels, and cancels the requests whose gateway's lease lapsed
(gpu_worker.serve.lease_watch).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpu_worker.serve.admission import Admission
from gpu_worker.serve.entry_closer import EntryCloser
from gpu_worker.serve.lease_watch import LeaseWatch
from shared import keys, streams
from shared.blocks import request_blocks
from shared.outage_log import OutageLog
from shared.settings import Settings

log = logging.getLogger("kvfleet.worker")

CLAIM_MIN_IDLE_MS = 1000
READ_BLOCK_MS = 1000  # the longest blocking read of its own stream (it returns at once when a request arrives)
# A reader thread that keeps failing waits up to this long between tries: the worker reads again within a second of
# Redis's return (at 5 s, a 6 s outage kept it deaf for 11). The log says each outage once (shared.outage_log).
MAX_BACKOFF_S = 1.0
# With room to spare, look at the shared stream's head this often while it holds requests; while it holds none
# (the router placed everything: the common case) every SHARED_LOOK_MS, doubling with each empty look up to
# READ_BLOCK_MS. A worker that just got room again (the fleet was full: requests may have overflowed there)
# looks at once. So an idle fleet polls about once a second per worker, however fast requests arrive on the
# worker's own stream.
SPARE_READ_BLOCK_MS = 50
SHARED_LOOK_MS = 200
# While the last look found requests waiting in the shared stream, or the main thread has yet to account what the
# reader handed it, the reader's own-stream reads block at most SPARE_READ_BLOCK_MS, room or not: room comes back
# when the main thread has accounted what it took (the next engine step), and a one-second read then held the shared
# stream's requests back for a second each (a burst of 64 overflowing there drained at one a second from an idle
# worker; a burst of 512 ran 0.5 s of steps with half the sequences it could). A look takes as many as fit, up to:
# a busy worker's main thread accounts them once a step.
SHARED_TAKE_MAX = 32
ORPHAN_SLACK_MS = 1000  # an entry delivered this long before the failed turn began may still be its orphan


@dataclass
class Cancel:
    request_id: str


@dataclass
class Room:
    """What the main thread last saw of its engine: the reader decides from it whether to take more."""

    own_backlog: bool = True  # may read its own stream
    spare: bool = False  # may take from the shared stream and from dead workers
    draining: bool = False
    accounted: int = 0  # jobs the main thread had taken from the inbox when it judged `spare`
    total_blocks: int = 0  # the engine's whole KV cache (0: not known yet)
    available_blocks: int = 0  # free blocks less those the requests it holds will still claim
    block_size: int = 16
    idle: bool = False  # nothing running or waiting
    free_seqs: int = 1  # sequences it may still start (max_num_seqs less those running or waiting)


class Intake:
    def __init__(self, r: streams.Client, settings: Settings, worker_id: str, inbox: queue.Queue,
                 room: Callable[[], Room], *, metrics: Any = None, on_regroup: Callable[[], None] | None = None,
                 leased: Callable[[], list[str]] | None = None, writes_refused: Callable[[], bool] | None = None,
                 precompile: Any = None):
        self.r, self.settings, self.worker_id = r, settings, worker_id
        self.on_regroup = on_regroup  # after Redis lost the groups: the worker publishes its status at once
        self.redis_failing: set[str] = set()  # the threads whose last turn failed on Redis (-> not ready)
        self.inbox, self.room = inbox, room
        self.shard = settings.worker_shard  # every stream and key it reads or writes is in its shard
        # judges each entry it reads or claims: a Job into the inbox, or the entry closed here (precompile: the
        # engine's grammar cache, gpu_worker.engine.structured.Grammars, or None)
        self.admission = Admission(r, settings, self.shard, inbox, room, EntryCloser(r, settings, worker_id, metrics),
                                   precompile)
        self.settled = self.admission.settled  # requests whose entry it closed itself (see Admission)
        # leased: the request ids the worker holds that carry a lease
        self.leases = LeaseWatch(r, self.shard, leased, writes_refused) if leased is not None else None
        self.own, self.shared = keys.req_stream(worker_id, self.shard), keys.req_any(self.shard)
        # keys of another type (another program's writes) it met: its reads go around them until they are gone
        self.avoided = streams.Avoided(r, f"worker {worker_id}'s reader")
        self._stop = threading.Event()
        self._dead: list[str] = []
        self._shard_streams: list[str] = []  # the request streams, as the last scan that found a dead one read them
        self._next_scan = 0.0
        self._on_redis_since = float("-inf")  # monotonic: its Redis calls have gone through without a break since
        self._next_shared_look = 0.0  # monotonic time of the next look at the shared stream's head
        self._empty_looks = 0  # looks in a row that found the shared stream empty
        self._shared_waiting = False  # the last look found requests waiting there
        self._was_spare = False
        self._recheck: queue.SimpleQueue[streams.Ack] = queue.SimpleQueue()  # entries of refused writes
        # monotonic start of the first request-read turn that failed on Redis since the last look for orphans
        self._orphans_since: float | None = None
        self._threads = [threading.Thread(target=self._requests, name="kvfleet-intake", daemon=True),
                         threading.Thread(target=self._cancels, name="kvfleet-cancels", daemon=True)]

    @property
    def handed(self) -> int:
        """Jobs put into the inbox so far: `spare` is stale until the main thread accounted them all."""
        return self.admission.handed

    def start(self, stopping: Callable[[], bool] = lambda: False) -> Intake:
        """Join the fleet's streams and take what a previous run under this id left pending, then start the
        reader threads. While Redis is away (restarting, say, just as the worker got ready) it waits, doubling
        from 0.1 s up to MAX_BACKOFF_S, until Redis answers or `stopping()` (a signal meanwhile: the threads are
        then not started)."""
        failures, outage = 0, OutageLog(log, "redis unavailable at start: joining the fleet")
        while not stopping():
            try:
                if failures:
                    self._on_redis_since = time.monotonic()
                self._join()
                self.redis_failing.discard("start")
                outage.ok()
                break
            except streams.RedisError as e:
                if self.avoided.met(e, self._names()):  # logged there; the next try goes around it
                    time.sleep(0.1)
                    continue
                failures += 1
                self.redis_failing.add("start")
                outage.failed(e, "waiting for it")
                time.sleep(min(0.1 * 2 ** (failures - 1), MAX_BACKOFF_S))
        else:
            return self
        for t in self._threads:
            t.start()
        return self

    def _join(self) -> None:
        self._ensure_groups()
        self._cancel_from = "0-0" if keys.CANCEL in self.avoided else streams.cancel_cursor(self.r)
        self._claim_own()  # what a previous run under this id left pending

    def _ensure_groups(self) -> None:
        """Its own stream's and its shard's shared stream's consumer groups (and the streams), and its shard in
        the fleet's shards: those of them that are no key of another type."""
        for stream in (self.own, self.shared):
            if stream not in self.avoided:
                streams.ensure_group(self.r, stream)
        if keys.SHARDS not in self.avoided:
            streams.register_shard(self.r, self.shard)

    def _names(self) -> list[str]:
        """The keys its reads touch, where a WRONGTYPE may come from (streams.Avoided.met)."""
        names = [self.own, self.shared, keys.SHARDS, keys.CANCEL, keys.DEAD,
                 keys.status(self.worker_id, self.shard), *self._shard_streams,
                 *(keys.req_stream(d, self.shard) for d in self._dead)]
        try:
            names += self._request_streams()
        except streams.RedisError:
            pass
        return names

    def _request_streams(self) -> list[str]:
        """streams.request_streams, but for those of another type (a workers set of another type is read around
        there: streams.shard_workers)."""
        return [s for s in streams.request_streams(self.r, self.shard) if s not in self.avoided]

    def stop(self) -> None:
        self._stop.set()

    def recheck(self, ack: streams.Ack) -> None:
        """The worker's writes under `ack` were refused: if the entry is still pending on this worker (with
        another delivery count, as after Redis came back from an AOF that lost the last claim), claim it again
        and take it, resumed from its output so far; else another worker owns it now."""
        self._recheck.put(ack)

    def dead_threads(self) -> list[str]:
        """Reader threads that ended although the intake was not stopped (the worker is then deaf)."""
        return [t.name for t in self._threads if t.ident is not None and not t.is_alive() and not self._stop.is_set()]

    def _survive(self, turn: Callable[[], Any], what: str) -> None:
        """Run `turn` until stopped; an error is logged (with its traceback unless Redis is away) and the
        next turn waits, doubling from 0.1 s up to MAX_BACKOFF_S while the errors go on. A missing consumer
        group (Redis restarted without its data, or was flushed) makes the next turn create the groups again."""
        failures, regroup, outage = 0, False, OutageLog(log, f"redis {what}")
        while not self._stop.is_set():
            try:
                if regroup:
                    self._regroup()
                    regroup = False
                began = time.monotonic()
                self.admission.compile_seconds()  # (from 0 for this turn)
                if failures:  # a try after failed ones: if it goes through, Redis is back from this moment
                    self._on_redis_since = began
                turn()
                # a long grammar compile is not Redis hanging: it does not delay taking over dead workers
                if time.monotonic() - began - self.admission.compile_seconds() > self.settings.status_ttl_s:
                    self._on_redis_since = time.monotonic()  # its calls hung: Redis was paused, say
                failures = 0
                self.redis_failing.discard(what)
                outage.ok()
            except streams.RedisError as e:
                if self.avoided.met(e, self._names()):  # logged there; the next turn goes around it
                    failures = 1
                    self._stop.wait(0.1)
                    continue
                failures += 1
                self.redis_failing.add(what)
                regroup = regroup or streams.group_missing(e)
                outage.failed(e)
            except Exception:  # noqa: BLE001 (a reader thread must not die)
                failures += 1
                log.exception("unexpected error in the %s thread (%d in a row); carrying on", what, failures)
            if failures:
                self._stop.wait(min(0.1 * 2 ** (failures - 1), MAX_BACKOFF_S))

    def _regroup(self) -> None:
        """A read found a consumer group gone: Redis lost them (restarted without its data), or another worker
        forgot a dead worker whose stream this one read too. Create its own groups (and their streams) again,
        forget the dead workers it knew, and have the worker re-register (status, its shard's workers set) at once."""
        log.warning("a consumer group is gone (Redis restarted without its data, or a dead worker's stream was "
                    "pruned as this worker read it): creating its own again")
        self._ensure_groups()
        self._dead, self._next_scan = [], 0.0
        if self.on_regroup is not None:
            self.on_regroup()

    # ---- requests ----------------------------------------------------------------------------
    def _requests(self) -> None:
        self._survive(self._request_turn, "request read")

    def _request_turn(self) -> None:
        """One turn of the request reader. A turn that failed on Redis may have been answered all the same: a
        read or a claim whose reply was lost with the connection (Redis stopped just after it answered, a socket
        timeout) has delivered its entries to this worker, which never got them (its client sends nothing twice:
        streams.NO_RESEND), and so has a read whose entries the turn did not get to take. They are pending here
        with nobody to run them, their readers waiting out their timeout: the next turn that reaches Redis
        takes them (_claim_own)."""
        began = time.monotonic()
        try:
            if self._orphans_since is not None:
                self._claim_own(delivered_within_ms=int(1000 * (time.monotonic() - self._orphans_since))
                                + ORPHAN_SLACK_MS)
                self._orphans_since = None
            self._read_once()
        except streams.RedisError:
            if self._orphans_since is None:
                self._orphans_since = began
            raise

    def _claim_own(self, delivered_within_ms: int | None = None) -> None:
        """Claim back (and take) what is pending on this worker id but was not taken by this run (what it took is
        in `admission.latest`), on its own stream, the shared one and the streams of workers it took for dead. At
        start: all of it (a previous run's, or a try of the start that Redis broke off). After a failed turn: what
        was delivered within `delivered_within_ms`, by reads whose reply was lost (one delivered before, which
        `admission.latest` may have forgotten if thousands came after it, is left alone); nobody ran those, so a
        gateway's request among them runs here instead of going back to its gateway."""
        lost_replies = delivered_within_ms is not None
        for stream in dict.fromkeys(s for s in [self.own, *self._request_streams()] if s not in self.avoided):
            taken = self.admission.taken_on(stream)
            claimed = streams.claim_pending(self.r, stream, self.worker_id, self.worker_id, min_idle_ms=0, skip=taken,
                                            max_idle_ms=delivered_within_ms)
            for d in claimed:
                if d.fields is not None:  # None: the entry was deleted meanwhile
                    self.admission.take(d, first_run=lost_replies and d.deliveries == 2)
            if claimed and lost_replies:
                log.warning("claimed %d request(s) on %s delivered here by reads whose reply was lost", len(claimed),
                            stream)
            elif claimed:
                log.info("claimed %d request(s) left pending by %s on %s", len(claimed), self.worker_id, stream)

    def _spare(self) -> bool:
        room = self.room()
        return room.spare and room.accounted >= self.handed

    def _read_once(self) -> None:
        if self.avoided.recheck():  # a key of another type is gone: its group, its shard's member, made again
            self._ensure_groups()
        room = self.room()
        if room.draining:
            time.sleep(0.1)
            return
        while not self._recheck.empty():
            ack = self._recheck.get_nowait()
            if self.admission.taken_since(ack):
                continue  # taken again since that delivery was refused
            if (d := streams.reclaim_own(self.r, ack, self.worker_id)) is not None:
                log.warning("request entry %s on %s is still pending here: claimed again", d.entry_id, d.stream)
                self.admission.take(d)
        if time.monotonic() >= self._next_scan:  # takeover needs no room: what it claims queues like new work
            self._next_scan = time.monotonic() + self.settings.heartbeat_s
            self._scan_dead()
            if self._dead and self._claim_dead():
                return
        spare = self._spare()
        if spare and not self._was_spare:  # room again: look at once
            self._next_shared_look, self._empty_looks = 0.0, 0
        self._was_spare = spare
        if (spare and time.monotonic() >= self._next_shared_look and self.shared not in self.avoided
                and self._take_shared(room)):
            return
        want: dict[str, str] = {}
        if room.own_backlog:  # its own stream, and the new entries on dead workers' streams like its own
            want[self.own] = ">"
            want.update({keys.req_stream(d, self.shard): ">" for d in self._dead})
            want = {stream: at for stream, at in want.items() if stream not in self.avoided}
        if not want:
            time.sleep(0.02)
            return
        # until the next scan for dead workers, and the next look at the shared stream when there is room for its head
        now = time.monotonic()
        until_ms = min(READ_BLOCK_MS, 1000 * (self._next_scan - now))
        if spare:
            until_ms = min(until_ms, 1000 * (self._next_shared_look - now))
        elif self._shared_waiting or self.handed > room.accounted:
            # requests wait there, or the main thread has yet to account what this thread handed it (its room then
            # changes, and the look at the shared stream that follows must not wait out a one-second read)
            until_ms = min(until_ms, SPARE_READ_BLOCK_MS)
        block_ms = int(max(SPARE_READ_BLOCK_MS, until_ms))
        taken_for_dead = {keys.req_stream(d, self.shard): d for d in self._dead}
        for d in streams.read_requests(self.r, self.worker_id, want, count=8, block_ms=block_ms):
            self.admission.take(d)
            if (owner := taken_for_dead.get(d.stream)) is not None:
                self._release_reservation(owner, d)

    def _release_reservation(self, owner: str, d: streams.Delivery) -> None:
        """A request taken from the stream of a worker taken for dead: the router reserved its blocks there, and
        that worker may be back already (the list of dead ones is up to a heartbeat old, and a blocking read can
        outlast its return): its status would never count the request, so the reservation is dropped here."""
        try:
            request_id = streams.parse_request(d.fields or {}).request_id
        except (KeyError, TypeError, ValueError):
            return  # malformed: admission dead-lettered it
        streams.release_reservation(self.r, owner, request_id, self.shard)

    def _take_shared(self, room: Room) -> bool:
        """Take the oldest untaken requests of the shared stream, in order, as many as fit this worker now: its free
        blocks (the first one whatever its size when this worker is idle) and its free sequence slots, at most
        SHARED_TAKE_MAX. Those that do not fit stay, in order, for a worker with more room."""
        heads = streams.shared_heads(self.r, self.shard, count=max(1, min(room.free_seqs, SHARED_TAKE_MAX)))
        self._shared_waiting = bool(heads)
        self._empty_looks = 0 if heads else self._empty_looks + 1
        wait_ms = (SPARE_READ_BLOCK_MS if heads
                   else min(SHARED_LOOK_MS * 2 ** (self._empty_looks - 1), READ_BLOCK_MS))
        self._next_shared_look = time.monotonic() + wait_ms / 1000
        fit = leading_fit((self._blocks_needed(fields, room.block_size) for fields in heads),
                          room.available_blocks - self.settings.reserve_blocks, room.idle)
        if not fit:
            return False
        taken = streams.read_requests(self.r, self.worker_id, {self.shared: ">"}, count=fit)
        for d in taken:
            self.admission.take(d)
        if taken:
            self._next_shared_look = 0.0  # the next ones may fit too
        return bool(taken)

    def _blocks_needed(self, fields: dict[str, str], block_size: int) -> int:
        """What routing counts for a shared stream entry (prompt plus capped output, times n); 0 for a malformed
        one, so that it is taken and admission dead-letters it."""
        try:
            request = streams.parse_request(fields)
            params = request.params()
        except (KeyError, TypeError, ValueError):
            return 0
        return request_blocks(len(request.prompt_token_ids),
                              min(params.max_tokens or 1, self.settings.route_max_output_tokens), params.n, block_size)

    def _scan_dead(self) -> None:
        """Find the shard's workers whose status expired; forget those that left nothing behind. None while this
        worker has been back on Redis for less than a status TTL (see the module's docstring, 2.)."""
        if time.monotonic() - self._on_redis_since < self.settings.status_ttl_s:
            self._dead = []
            return
        self._dead = [w for w, s in streams.other_workers(self.r, self.worker_id, self.shard).items()
                      if s is None and keys.req_stream(w, self.shard) not in self.avoided]
        if not self._dead:
            return
        self._shard_streams = self._request_streams()  # for the prunes and _claim_dead
        for dead in list(self._dead):
            if streams.prune_dead_worker(self.r, dead, self.shard, self._shard_streams):
                log.info("forgot dead worker %s", dead)
                self._dead.remove(dead)

    def _claim_dead(self) -> int:
        """Claim everything dead workers left pending, whether or not this worker has room (the engine queues
        what it cannot run yet); their output so far seeds each Job. On every stream of the shard: a worker that
        read new entries on the stream of a worker it took for dead (that one restarted, say) holds them there."""
        owners = streams.pending_owners(self.r, self._shard_streams)
        return sum(self._claim(stream, dead, min_idle_ms=CLAIM_MIN_IDLE_MS)
                   for stream, held in owners.items() for dead in self._dead if dead in held)

    def _claim(self, stream: str, owner: str, *, min_idle_ms: int) -> int:
        """Claim every entry `owner` left pending on `stream`, page by page, and take each."""
        claimed = streams.claim_pending(self.r, stream, owner, self.worker_id, min_idle_ms=min_idle_ms)
        for d in claimed:
            if d.fields is not None:  # None: the entry was deleted meanwhile
                self.admission.take(d)
        if claimed:
            log.info("claimed %d request(s) left pending by %s on %s", len(claimed), owner, stream)
        return len(claimed)

    # ---- cancels -----------------------------------------------------------------------------
    def _cancels(self) -> None:
        self._survive(self._cancel_turn, "cancel read")

    def _cancel_turn(self) -> None:
        self._read_cancels_once()
        for request_id in self.leases.lapsed() if self.leases is not None else []:
            self.inbox.put(Cancel(request_id))

    def _read_cancels_once(self) -> None:
        if keys.CANCEL in self.avoided:  # another type: no cancels to read (the lease check still runs)
            self._stop.wait(1.0)
            if self.avoided.recheck():
                self._ensure_groups()
            return
        self._cancel_from, request_ids = streams.read_cancels(self.r, self._cancel_from)
        for request_id in request_ids:
            self.inbox.put(Cancel(request_id))


def leading_fit(needs: Iterable[int], budget: int, idle: bool) -> int:
    """How many of the shared stream's oldest requests (the blocks each needs, in order) one look takes: while they
    fit `budget`, the free blocks beyond the reserve; the first whatever its size when the worker is idle. (The
    fleet simulator takes by the same rule.)"""
    fit = 0
    for need in needs:
        if need > budget and not (fit == 0 and idle):
            break
        fit, budget = fit + 1, budget - need
    return fit
