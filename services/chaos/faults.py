"""The fault injector: one fault at a time, a few seconds apart: each kind once, then at random, all from a
fixed seed. A fault that takes a part of the fleet away (a worker, a gateway, Redis: killed, or hung by SIGSTOP)
waits until the fleet is whole again (a stopped part continued, a killed one restarted and registered, Redis
started again), so at most one part is away at once; the others (CLIENT KILL, poison) come on time, while a part
may be restarting.
Redis outages are kept as time windows: a 503 redis_unavailable / redis_lost_request is expected only within
one."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from services.chaos.fleet import STATUS_TTL_S, ChaosFleet
from shared import streams
from shared.settings import Settings

KINDS = ("worker_sigkill", "worker_sigterm", "worker_sigstop", "gateway_sigkill", "gateway_sigstop", "redis_restart",
         "redis_sigstop", "redis_client_kill", "poison", "foreign_writes")
# kinds after which a request in flight may be resumed by another worker from the tokens it had sent: the new
# worker computes their keys and values in one prefill, not token by token, so its logits can differ in the
# last bits, and a seeded sampled continuation may take another token where two were near-equal
# (a hung gateway or Redis: the request's lease lapses, and its gateway places it again after what it relayed)
HANDOVER = ("worker_sigkill", "worker_sigterm", "worker_sigstop", "gateway_sigstop", "redis_restart", "redis_sigstop")
TAKE_NOTHING_AWAY = ("redis_client_kill", "poison", "foreign_writes")  # kinds that need no whole fleet to hit
FOREIGN_STATUS_TTL_S = 20.0  # how long a foreign worker's unreadable status stays
WHOLE_TIMEOUT_S = 180.0  # a fleet not whole again by then: the next fault comes anyway (and the checks tell)
REDIS_AFTERMATH_S = 20.0  # 503s this long after Redis is back are still the outage's (readers' backoff)
LEASE_TTL_S = Settings().lease_ttl_s  # the fleet's (the soak leaves the default)


@dataclass
class FaultLog:
    counts: Counter = field(default_factory=Counter)
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (when it began, kind, target)
    redis_windows: list[tuple[float, float]] = field(default_factory=list)  # (down, back + aftermath)

    def in_redis_outage(self, t0: float, t1: float) -> bool:
        return any(t0 <= end and t1 >= start for start, end in self.redis_windows)

    def handover_during(self, t0: float, t1: float) -> str | None:
        """The first fault in [t0, t1] after which another worker may resume a request from its output so far
        (a worker killed, drained or stopped; Redis restarted), or None. A fault's time is when it began: a
        request in flight at a worker's SIGSTOP is taken over a status TTL later and may be finished elsewhere
        before the SIGCONT (seed 131 took such a request for a plain mismatch while the event's time was the
        SIGCONT's). A Redis restart counts for as long as it and its aftermath last (redis_windows), not only at
        the moment it began: a worker killed or stopped while Redis is down is taken over a status TTL after
        Redis is back, well past the restart's start (seed 97 saw a Celery task sent 0.2 s after Redis went down
        taken over 6 s later; a live worker's requests were taken over then too, which the workers no longer do:
        gpu_worker.serve.intake, 2.)."""
        kind = next((kind for t, kind, _ in self.events if kind in HANDOVER and t0 <= t <= t1), None)
        return kind or ("redis_restart" if self.in_redis_outage(t0, t1) else None)


class Injector:
    def __init__(self, fleet: ChaosFleet, seed: int, kinds: tuple[str, ...] = KINDS,
                 interval_s: tuple[float, float] = (3.0, 6.0)):
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; the kinds are {', '.join(KINDS)}")
        self.fleet, self.kinds, self.interval_s = fleet, kinds, interval_s
        self.rng = random.Random(seed)
        self.log = FaultLog()
        self._poison_due = 0  # the load threads send these
        self._poison_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        """Every kind once first (in a seeded order, so a short run covers them all), then at random."""
        first = self.rng.sample(self.kinds, len(self.kinds))
        while not self._stop.wait(self.rng.uniform(*self.interval_s)):
            kind = first.pop(0) if first else self.rng.choice(self.kinds)
            if kind not in TAKE_NOTHING_AWAY:
                self._wait_whole()
                if self._stop.is_set():
                    return
            began = time.time()
            target = getattr(self, kind)()
            self.log.counts[kind] += 1
            self.log.events.append((began, kind, target))

    def _wait_whole(self) -> None:
        """Until every process is back and every worker registered (a restarted worker loads its model first):
        the next fault hits a whole fleet, never one already missing a part."""
        deadline = time.monotonic() + WHOLE_TIMEOUT_S
        while not self._stop.is_set() and time.monotonic() < deadline and not self.fleet.ready():
            self._stop.wait(0.5)

    # ---- one method per kind; each returns what it hit --------------------------------------------
    def _worker(self):
        return self.rng.choice(self.fleet.workers)

    def worker_sigkill(self) -> str:
        w = self._worker()
        self.fleet.signal(w, signal.SIGKILL)
        return w.name

    def worker_sigterm(self) -> str:
        w = self._worker()
        self.fleet.signal(w, signal.SIGTERM)
        return w.name

    def worker_sigstop(self) -> str:
        """Longer than the status TTL: the others take its requests over; when it comes back it must not write."""
        w = self._worker()
        self.fleet.signal(w, signal.SIGSTOP)
        self._stop.wait(STATUS_TTL_S + self.rng.uniform(1.0, 3.0))
        self.fleet.signal(w, signal.SIGCONT)
        return w.name

    def gateway_sigkill(self) -> str:
        g = self.rng.choice(self.fleet.gateways)
        self.fleet.signal(g, signal.SIGKILL)
        return g.name

    def gateway_sigstop(self) -> str:
        """A hung gateway, past the lease TTL: the workers take its requests for abandoned and abort them, and when
        it goes on it places them again after what it relayed (or, back before a worker confirmed the lapse, it
        sets the lease again and the worker goes on); its clients, which only waited, get every token once."""
        g = self.rng.choice(self.fleet.gateways)
        self.fleet.signal(g, signal.SIGSTOP)
        try:
            self._stop.wait(LEASE_TTL_S + self.rng.uniform(1.0, 5.0))
        finally:
            self.fleet.signal(g, signal.SIGCONT)
        return g.name

    def redis_sigstop(self) -> str:
        """A hung Redis (every connection open, every command waiting), past the status TTL and at times the
        lease TTL, under the readers' grace (15 s): statuses and leases expire as if it were gone, but nothing
        was lost; no live worker may take another's requests over, nothing accepted may fail."""
        down = time.time()
        self.fleet.pause_redis()
        try:
            self._stop.wait(self.rng.uniform(STATUS_TTL_S + 1.0, LEASE_TTL_S + 4.0))
        finally:
            self.fleet.resume_redis()
        self.log.redis_windows.append((down, time.time() + REDIS_AFTERMATH_S))
        return f"port {self.fleet.redis.port}"

    def redis_restart(self) -> str:
        down = time.time()
        self.fleet.kill_redis()
        time.sleep(self.rng.uniform(0.5, 3.0))  # shorter than the readers' grace (15 s): streams pause, go on
        self.fleet.start_redis()
        self.log.redis_windows.append((down, time.time() + REDIS_AFTERMATH_S))
        return f"port {self.fleet.redis.port}"

    def redis_client_kill(self) -> str:
        try:
            r = streams.connect(self.fleet.redis.url)
            try:
                return f"{streams.kill_clients(r)} connections"
            finally:
                r.close()
        except streams.RedisError as e:
            return f"failed: {e}"

    def foreign_writes(self) -> str:
        """What another kvfleet version or another program may leave in Redis: a worker registered with a status
        this version cannot read (for FOREIGN_STATUS_TTL_S; then it is a dead worker with nothing to take over),
        its request stream kept as a string (for twice that), a cancel entry without a request id, reservations on a
        live worker that are no block count or more than its cache, a member of the shards' set and a round-robin
        counter that are not numbers, and the shard's workers set replaced by a string for FOREIGN_STATUS_TTL_S
        (streams.plant_foreign_state). Before, the status, the reservation and the member each failed every request
        with a 500, the counter every round-robin route, the cancel entry stopped the workers' cancel readers for
        good, the stream of another type every read turn of the workers of its shard (their takeover scan met it),
        the huge count made that worker look full, and the workers set of another type got every request a 503
        and stopped the takeover."""
        worker_id = f"w-foreign-{self.log.counts['foreign_writes']}"
        beside = self._worker().name
        try:
            r = streams.connect(self.fleet.redis.url)
            try:
                streams.plant_foreign_state(r, worker_id, FOREIGN_STATUS_TTL_S, beside=beside,
                                            workers_set_s=FOREIGN_STATUS_TTL_S)
                return worker_id
            finally:
                r.close()
        except streams.RedisError as e:
            return f"failed: {e}"

    def poison(self) -> str:
        with self._poison_lock:
            self._poison_due += 3
        return "3 requests"

    def take_poison(self) -> bool:
        """Called by a load thread: should its next request be a poison one?"""
        with self._poison_lock:
            if self._poison_due <= 0:
                return False
            self._poison_due -= 1
            return True
