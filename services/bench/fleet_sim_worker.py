"""One simulated worker of the fleet simulator: the real gpu_worker.core Scheduler (with its KVCacheManager and
prefix cache), driven step by step as gpu_worker.engine.llm_engine.LLMEngine.step drives it, and as
gpu_worker.serve.worker.Worker.tick loops: take what arrived, step once, snapshot the status. A step's
duration is the cost model's (CostProfile.step_seconds of the step's shape); the model is not run.

What reaches the gateway, as in the real worker: its WorkerStatus (free blocks, blocks promised to the
requests it holds as RequestTracker.promised_blocks counts them, running, waiting), published when it changed
but at most `status_max_hz` times a second (the outbox's rate), and the reservations that status covers.
The intake as gpu_worker.serve.intake reads: its own stream while its backlog is short, and the shared
stream's head only when it has room to spare.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.request import Request
from gpu_worker.core.sched_output import SchedulerOutput
from gpu_worker.core.scheduler import Scheduler
from gpu_worker.executor.cost_model import CostProfile, StepShape, sim_token
from gpu_worker.serve.intake import leading_fit
from services.bench.fleet_sim_workloads import VOCAB_SIZE, SimRequest
from shared.blocks import request_blocks
from shared.messages import WorkerStatus
from shared.sampling_params import SamplingParams
from shared.settings import Settings

MAX_BACKLOG = 32  # gpu_worker.serve.worker.Worker's default max_backlog: it reads its stream below this
MIN_STEP_S = 1e-4  # an empty step (nothing could be scheduled) still takes time, so the clock moves


@dataclass(frozen=True)
class Snapshot:
    """What a status says that routing reads (gpu_worker.serve.worker.Worker._status)."""

    free_blocks: int
    promised_blocks: int
    running: int
    waiting: int
    num_preemptions: int

    @property
    def available_blocks(self) -> int:
        return self.free_blocks - self.promised_blocks


@dataclass
class Trace:
    """What a client of one request sees: when it was sent, where it went, when each token came."""

    request: SimRequest
    sent_s: float = 0.0  # when the client sent it (its arrival, or later for a chat turn that waited)
    worker: str | None = None  # None while in the shared queue
    token_times: list[float] = field(default_factory=list)
    finish_s: float | None = None
    cached_tokens: int = 0  # prefix-cache hit at its first admission
    preemptions: int = 0


class SimWorker:
    def __init__(self, worker_id: str, profile: CostProfile, settings: Settings, *, max_model_len: int,
                 model: str, token_seed: int, clock: Callable[[], float]):
        self.worker_id, self.profile, self.settings = worker_id, profile, settings
        self.model, self.token_seed, self.max_model_len = model, token_seed, max_model_len
        sched_cfg = SchedulerConfig(max_num_seqs=profile.max_num_seqs,
                                    max_num_batched_tokens=profile.max_num_batched_tokens, max_model_len=max_model_len)
        cache_cfg = CacheConfig(block_size=profile.block_size, num_blocks=profile.num_kv_blocks)
        self.scheduler = Scheduler(sched_cfg, cache_cfg, clock=clock)
        # The step's block tables and slot mappings are for the model runner, which is not run: skip building
        # them (pure lookups: the cache manager's state is the same without them).
        kvm = self.scheduler.kv_cache_manager
        kvm.get_block_ids = lambda _rid: []
        kvm.slot_mapping = lambda _rid, _start, _n: []
        self.block_size = profile.block_size
        self.stream: deque[Trace] = deque()  # routed here, not read yet
        self.inbox: deque[Trace] = deque()  # read, not yet added to the engine
        self.held: dict[str, tuple[Request, Trace]] = {}  # in the engine, not finished
        self.busy = False  # a step is running
        self._step: SchedulerOutput | None = None
        self.snapshot = self._snapshot()  # the latest status (what the outbox would publish next)
        self.published: Snapshot | None = None
        self.last_pub = float("-inf")
        self.publish_due = False  # a rate-limited publish is scheduled
        self.taken: list[str] = []  # added since the last snapshot: their reservations go with the next one
        self.covered: list[str] = []  # taken requests the latest snapshot accounts for
        self.steps = 0

    # ---- the main loop, one tick at a time ---------------------------------------------------------
    def begin_tick(self, now: float) -> float | None:
        """Take the inbox into the engine and start a step: its end time, or None when there is nothing to do."""
        while self.inbox:
            self._add(self.inbox.popleft(), now)
        if not self.held:
            return None
        self._step = self.scheduler.schedule()
        self.busy = True
        self.steps += 1
        return now + max(self.profile.step_seconds(StepShape.of(self._step)), MIN_STEP_S)

    def end_step(self, now: float) -> list[Trace]:
        """The step's end, as LLMEngine.step finishes it: one sampled token per sampling sequence, then
        update_from_output (which caches the written blocks and frees finished requests). Returns those finished."""
        sched, self._step, self.busy = self._step, None, False
        assert sched is not None
        sampled = {s.request_id: sim_token(self.token_seed, s.request_id,
                                           self.held[s.request_id][0].num_output_tokens, VOCAB_SIZE)
                   for s in sched.seqs if s.sample}
        finished = self.scheduler.update_from_output(sched, sampled)
        for s in sched.seqs:
            request, trace = self.held[s.request_id]
            trace.cached_tokens = request.num_cached_tokens
            if s.sample and len(trace.token_times) < request.num_output_tokens:
                trace.token_times.append(now)
        done = []
        for request in finished:
            _, trace = self.held.pop(request.request_id)
            trace.finish_s, trace.preemptions = now, request.num_preemptions
            done.append(trace)
        return done

    def _add(self, trace: Trace, now: float) -> None:
        req = trace.request
        request = Request(req.request_id, req.prompt, _params(req.output_len), arrival_time=now)
        self.scheduler.add_request(request)
        self.held[req.request_id] = (request, trace)
        self.taken.append(req.request_id)

    def end_tick(self, now: float) -> None:
        """After a step (or on waking): the status snapshot the outbox will publish."""
        self.snapshot = self._snapshot()
        self.covered += self.taken
        self.taken = []

    # ---- what the gateway sees ---------------------------------------------------------------------
    def status(self, now: float) -> WorkerStatus:
        """The WorkerStatus of the latest snapshot, as the gateway reads it."""
        s = self.snapshot
        return WorkerStatus.model_construct(
            worker_id=self.worker_id, model=self.model, model_path="", max_model_len=self.max_model_len,
            block_size=self.block_size, total_blocks=self.profile.num_kv_blocks, free_blocks=s.free_blocks,
            promised_blocks=s.promised_blocks, running=s.running, waiting=s.waiting,
            num_preemptions=s.num_preemptions, heartbeat=now, draining=False)

    def _snapshot(self) -> Snapshot:
        """Scheduler.stats()'s counts that the status carries (read directly: stats() also measures
        fragmentation, which costs a walk over every block table)."""
        sched = self.scheduler
        return Snapshot(sched.kv_cache_manager.block_pool.num_free_blocks, self._promised_blocks(),
                        len(sched.running), len(sched.waiting), sched.num_preemptions)

    def _promised_blocks(self) -> int:
        """As gpu_worker.serve.request_tracker.RequestTracker.promised_blocks: per request held, what routing
        counts for it (prompt plus output up to route_max_output_tokens) less what the tokens it has sent hold."""
        cap, bs, total = self.settings.route_max_output_tokens, self.block_size, 0
        for request, _ in self.held.values():
            need = request_blocks(request.num_prompt_tokens, min(request.max_tokens, cap), 1, bs)
            sent = request.num_output_tokens
            held = request_blocks(request.num_prompt_tokens, sent, 1, bs) if sent else 0
            total += max(0, need - held)
        return total

    def changed(self) -> bool:
        """The snapshot differs from what was published (the outbox's same_state, heartbeat aside)."""
        return self.published != self.snapshot or bool(self.covered)

    def backlog(self) -> int:
        return self.snapshot.waiting + len(self.inbox)

    def may_read_own(self) -> bool:
        return self.backlog() < MAX_BACKLOG

    def spare(self) -> bool:
        """Room for the shared stream's head (intake: nothing waiting, everything handed accounted, free
        blocks beyond the reserve)."""
        return self.backlog() == 0 and self.snapshot.available_blocks > self.settings.reserve_blocks

    def shared_fit(self, traces: Iterable[Trace], most: int) -> int:
        """How many of the shared stream's oldest requests (in order) the intake's look takes: as many as fit the free
        blocks beyond the reserve (the first whatever its size when the worker is idle) and its free sequence
        slots, at most `most`."""
        s, cap = self.snapshot, self.settings.route_max_output_tokens
        limit = max(1, min(most, self.profile.max_num_seqs - s.running - self.backlog()))
        needs = (request_blocks(len(t.request.prompt), min(t.request.output_len, cap), 1, self.block_size)
                 for t in itertools.islice(traces, limit))
        return leading_fit(needs, s.available_blocks - self.settings.reserve_blocks, not self.held and not self.inbox)


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
