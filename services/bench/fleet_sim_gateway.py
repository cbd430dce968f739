"""The gateway side of the fleet simulator: gateway.placement._route_and_enqueue with Redis replaced by plain
state, calling the real router (gateway.router.route, prefix_overlap) and the real block arithmetic
(shared.blocks).

What Redis holds for the gateway is kept here as it would be: each worker's last published status (the router
sees only that), the reservations (kvfleet:reserved:{worker}: request id -> blocks, dropped when a status that
covers them is published; the whole hash expires `reservation_ttl_s` after the last push of its expiry: at its
creation, and by an enqueue a third of that after the previous push), the prefix index
(block hash -> the last PREFIX_OWNERS workers it was routed to, PREFIX_TTL_S), the round-robin turn. The atomic
enqueue checks of shared.streams.requests (_ENQUEUE_ROUTED's Lua: the worker's queue bound for every policy, the headroom for
free_blocks and prefix) are re-stated in `_enqueue_ok`.
"""

from __future__ import annotations

from collections import deque

from gateway.placement import MAX_ROUTE_TRIES
from gateway.router import prefix_overlap, route
from services.bench.fleet_sim_worker import SimWorker, Trace
from shared.blocks import block_hashes, request_blocks
from shared.messages import WorkerStatus
from shared.settings import Settings
from shared.streams.fleet import PREFIX_OWNERS, PREFIX_TTL_S


class SimGateway:
    def __init__(self, policy: str, settings: Settings, workers: dict[str, SimWorker]):
        self.policy, self.settings, self.workers = policy, settings, workers
        self.model = next(iter(workers.values())).model
        self.statuses: dict[str, WorkerStatus] = {}  # worker -> its last published status
        self.reserved: dict[str, dict[str, int]] = {w: {} for w in workers}
        self.reserved_until: dict[str, float] = {w: 0.0 for w in workers}
        self.expiry_pushed: dict[str, float] = {w: float("-inf") for w in workers}
        self.prefix_index: dict[str, tuple[list[str], float]] = {}  # block hash -> (workers, expires at)
        self.turn = 0
        self.shared: deque[Trace] = deque()  # kvfleet:req:any
        self.routed_to_shared = 0

    # ---- what the workers write ---------------------------------------------------------------------
    def publish(self, worker: SimWorker, now: float) -> None:
        """The worker's status goes out, and with it the HDEL of the reservations it now covers."""
        self.statuses[worker.worker_id] = worker.status(now)
        held = self.reserved[worker.worker_id]
        for rid in worker.covered:
            held.pop(rid, None)
        worker.covered = []
        worker.published, worker.last_pub = worker.snapshot, now

    def reservations(self, now: float) -> dict[str, int]:
        """Blocks reserved per worker; a hash past its expiry is gone, entries and all."""
        for w, until in self.reserved_until.items():
            if now >= until:
                self.reserved[w].clear()
        return {w: sum(held.values()) for w, held in self.reserved.items()}

    # ---- placing a request --------------------------------------------------------------------------
    def place(self, trace: Trace, now: float) -> str | None:
        """Route, check and enqueue on a worker's stream (returns it), or on the shared stream (None)."""
        req, settings, policy = trace.request, self.settings, self.policy
        bs = next(iter(self.statuses.values())).block_size
        max_total = max(s.total_blocks for s in self.statuses.values())
        blocks = min(request_blocks(len(req.prompt), min(req.output_len, settings.route_max_output_tokens), 1, bs),
                     max_total)
        refused: set[str] = set()
        hashes: list[str] = []
        if policy == "prefix":
            hashes = block_hashes(req.prompt, bs, self.model)
        for _ in range(MAX_ROUTE_TRIES):
            candidates = [s for s in self.statuses.values() if s.worker_id not in refused]
            reservations = self.reservations(now)
            overlap: dict[str, int] = {}
            if hashes:
                overlap = prefix_overlap([self._owners(h, now) for h in hashes])
            elif policy == "round_robin":
                self.turn += 1
            worker = route(blocks, candidates, policy, reservations, reserve_blocks=settings.reserve_blocks,
                           turn=self.turn, prompt_blocks=len(hashes), prefix_overlap=overlap,
                           prefill_weight=settings.prefix_weight,
                           affinity_slack=settings.prefix_affinity_slack)
            if worker is None:
                break
            if self._enqueue_ok(worker, blocks, reservations):
                if not self.reserved[worker] or now - self.expiry_pushed[worker] >= settings.reservation_ttl_s / 3:
                    self.reserved_until[worker], self.expiry_pushed[worker] = now + settings.reservation_ttl_s, now
                self.reserved[worker][req.request_id] = blocks
                for h in hashes:  # shared.streams.aremember_prefix's script
                    kept = [w for w in self._owners(h, now) if w != worker][:PREFIX_OWNERS - 1]
                    self.prefix_index[h] = ([worker, *kept], now + PREFIX_TTL_S)
                self.workers[worker].stream.append(trace)
                return worker
            refused.add(worker)
        self.shared.append(trace)
        self.routed_to_shared += 1
        return None

    def _owners(self, block_hash: str, now: float) -> list[str]:
        entry = self.prefix_index.get(block_hash)
        return entry[0] if entry is not None and now < entry[1] else []

    def _enqueue_ok(self, worker_id: str, blocks: int, reservations: dict[str, int]) -> bool:
        """_ENQUEUE_ROUTED's checks: fewer than worker_queue_bound waiting (reserved there, not yet covered by a
        status, plus its status' waiting); for free_blocks and prefix, the headroom after this request still >=
        reserve_blocks."""
        s = self.statuses[worker_id]
        if len(self.reserved[worker_id]) + s.waiting >= self.settings.worker_queue_bound:
            return False
        if self.policy in ("free_blocks", "prefix"):
            return s.free_blocks - s.promised_blocks - reservations[worker_id] - blocks >= self.settings.reserve_blocks
        return True
