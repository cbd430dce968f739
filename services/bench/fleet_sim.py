"""The fleet simulator (`kvfleet bench fleet-sim`): a discrete-event simulation, on a virtual clock, of a
gateway and N workers, in one process.

Each worker is the real Scheduler + KVCacheManager stepped with the cost model's step times
(services.bench.fleet_sim_worker); the gateway is the real router with its reservations, prefix index and
shared queue (services.bench.fleet_sim_gateway); statuses reach the router only when published, at the
worker's real rate. Three kinds of event, in time order (ties in the order they were scheduled):
  arrival   the gateway places the request: on a worker's stream (read at once while the worker's backlog
            is short; an idle worker wakes and steps) or on the shared stream;
  step end  the worker's step finishes: tokens out, finished requests freed; its status snapshot; it reads
            its stream and the shared stream's head (when it has room); the next step starts;
  publish   a rate-limited status goes out (also clearing the reservations it covers).
Not modelled: Redis and network latency (each hop is ~0.1-1 ms against steps of ms to s), heartbeats (they
repeat an unchanged status), the intake's poll interval (a worker with room sees the shared stream at once).
A chat's next turn is sent only after the previous one finished (services.bench.fleet_sim_workloads).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.executor.cost_model import CostProfile
from gpu_worker.serve.intake import SHARED_TAKE_MAX
from services.bench.fleet_sim_gateway import SimGateway
from services.bench.fleet_sim_worker import SimWorker, Trace
from services.bench.fleet_sim_workloads import MIN_THINK_S, SimRequest
from shared.blocks import blocks_for
from shared.settings import Settings

ARRIVAL, STEP_END, PUBLISH = 0, 1, 2
SIM_MODEL = "sim"


@dataclass
class SimRun:
    """One policy's run: every request's trace, and the fleet's counters."""

    policy: str
    traces: list[Trace]
    steps: int
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the workers' prefix caches
    prefix_hits: int
    routed_to_shared: int  # requests no worker could take on arrival (the shared queue)
    wall_s: float  # what the simulation itself took
    cpu_s: float  # ... in CPU time (this process), which other load on the machine does not inflate
    events: int


def default_settings() -> Settings:
    """The fleet settings the simulator routes with: the defaults, whatever the environment says."""
    return Settings(worker_id="sim")


class FleetSim:
    def __init__(self, policy: str, profile: CostProfile, num_workers: int, *, max_model_len: int = 16384,
                 settings: Settings | None = None, token_seed: int = 0):
        if not 1 <= num_workers <= 1024:
            raise ValueError(f"--workers must be in [1, 1024], got {num_workers}")
        self.settings = settings or default_settings()
        self.now = 0.0
        self.workers = {f"w{i:03d}": SimWorker(f"w{i:03d}", profile, self.settings, max_model_len=max_model_len,
                                               model=SIM_MODEL, token_seed=token_seed, clock=lambda: self.now)
                        for i in range(num_workers)}
        self.gateway = SimGateway(policy, self.settings, self.workers)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._followers: dict[str, Trace] = {}  # a chat turn's request id -> its next turn, held until it finishes
        self.events = 0
        for w in self.workers.values():
            self.gateway.publish(w, 0.0)

    def _at(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, requests: list[SimRequest], progress: Callable[[float], None] | None = None) -> SimRun:
        """Simulate until every request finished. `progress(now)` is called now and then."""
        self._check(requests)
        started, cpu_started = time.perf_counter(), time.process_time()
        traces = [Trace(r) for r in requests]
        self._followers = {t.request.after: t for t in traces if t.request.after is not None}
        for t in traces:
            if t.request.after is None:
                self._at(t.request.arrival_s, ARRIVAL, t)
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            self.events += 1
            if kind == ARRIVAL:
                self._arrive(payload)
            elif kind == STEP_END:
                for done in payload.end_step(self.now):
                    if (follower := self._followers.pop(done.request.request_id, None)) is not None:
                        self._at(max(follower.request.arrival_s, self.now + MIN_THINK_S), ARRIVAL, follower)
                self._tick_done(payload)
            else:
                payload.publish_due = False
                if payload.changed():
                    self.gateway.publish(payload, self.now)
            if progress is not None and self.events % 2048 == 0:
                progress(self.now)
        unfinished = [t.request.request_id for t in traces if t.finish_s is None]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} requests never finished (first: {unfinished[0]}): "
                               "a simulator bug; please report it with the command line")
        stats = [w.scheduler.stats() for w in self.workers.values()]
        return SimRun(self.gateway.policy, traces, sum(w.steps for w in self.workers.values()),
                      sum(s.num_preemptions for s in stats), sum(s.prefix_cache_queries for s in stats),
                      sum(s.prefix_cache_hits for s in stats), self.gateway.routed_to_shared,
                      time.perf_counter() - started, time.process_time() - cpu_started, self.events)

    def _check(self, requests: list[SimRequest]) -> None:
        """Every request must fit a worker whole (prompt and output), as the workload's exact lengths need."""
        worker = next(iter(self.workers.values()))
        cache, window = worker.profile.num_kv_blocks, worker.max_model_len
        for r in requests:
            tokens = len(r.prompt) + r.output_len
            if tokens > window or blocks_for(tokens, worker.block_size) > cache:
                raise ValueError(
                    f"request {r.request_id} needs {tokens} tokens ({blocks_for(tokens, worker.block_size)} KV "
                    f"blocks) but a worker holds {window} tokens (--max-model-len) and {cache} KV blocks (the "
                    "profile's num_kv_blocks): raise them, or use a workload of shorter requests")

    def _arrive(self, trace: Trace) -> None:
        trace.sent_s = self.now
        worker_id = self.gateway.place(trace, self.now)
        trace.worker = worker_id
        if worker_id is None:
            self._offer_shared()
            return
        worker = self.workers[worker_id]
        if worker.may_read_own():
            worker.inbox.extend(worker.stream)
            worker.stream.clear()
            if not worker.busy:
                self._tick(worker)

    def _tick(self, worker: SimWorker) -> None:
        """A worker's next step, if it has work (it wakes when a request is read)."""
        end = worker.begin_tick(self.now)
        if end is not None:
            self._at(end, STEP_END, worker)
        else:
            self._tick_done(worker)

    def _tick_done(self, worker: SimWorker) -> None:
        """The end of a tick: snapshot the status (publish it, or schedule that), read the streams, go on."""
        worker.end_tick(self.now)
        self._maybe_publish(worker)
        if worker.may_read_own() and worker.stream:
            worker.inbox.extend(worker.stream)
            worker.stream.clear()
        self._take_shared(worker)
        if worker.held or worker.inbox:
            end = worker.begin_tick(self.now)
            if end is not None:
                self._at(end, STEP_END, worker)

    def _maybe_publish(self, worker: SimWorker) -> None:
        if not worker.changed() or worker.publish_due:
            return
        period = 1.0 / self.settings.status_max_hz
        if self.now - worker.last_pub >= period:
            self.gateway.publish(worker, self.now)
        else:
            worker.publish_due = True
            self._at(worker.last_pub + period, PUBLISH, worker)

    def _take_shared(self, worker: SimWorker) -> bool:
        """The intake's _take_shared: with room, the shared stream's oldest requests that fit, in order."""
        shared = self.gateway.shared
        if not shared or not worker.spare():
            return False
        fit = worker.shared_fit(shared, SHARED_TAKE_MAX)
        for _ in range(fit):
            trace = shared.popleft()
            trace.worker = worker.worker_id
            worker.inbox.append(trace)
        return fit > 0

    def _offer_shared(self) -> None:
        """A request just went to the shared stream: an idle worker with room takes it at once."""
        for worker in self.workers.values():
            if not worker.busy and self._take_shared(worker):
                self._tick(worker)
                return
