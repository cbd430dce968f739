"""The scheduler: continuous batching over a paged KV cache (ints and ids only, no torch).

Each step: running requests first (decodes and unfinished chunked prefills, in admission order), then
waiting ones in the order the policy (gpu_worker.core.policies) picks, under a token budget and a sequence
cap. A running request that needs a block when none is free preempts the one the policy names (by default
the lowest-priority, latest-arriving): recompute, its blocks are freed and it goes back to the front of the
waiting queue, keeping priority and arrival time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache_manager import KVCacheManager, KVCacheStats
from gpu_worker.core.policies import make_policy
from gpu_worker.core.request import Request, RequestStatus
from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput

logger = logging.getLogger("kvfleet.scheduler")


class RequestRejected(ValueError):
    """A request that can never run here (too long for the context window or the whole KV cache)."""


@dataclass
class SchedulerStats(KVCacheStats):
    """The KV cache's statistics plus the queues' lengths and the preemptions so far."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0  # total since start


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cache_config.num_blocks < 1:
            raise ValueError(f"cache_config.num_blocks must be resolved to >= 1, got {cache_config.num_blocks}")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.policy = make_policy(scheduler_config.policy, block_size=self.block_size,
                                  sjf_aging_s=scheduler_config.sjf_aging_s)
        self.kv_cache_manager = KVCacheManager(self.block_size, cache_config.num_blocks,
                                               cache_config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, including unforked siblings
        self.num_preemptions = 0
        self._fork_point: dict[str, int] = {}  # group leader -> tokens it computes before its siblings fork
        self._siblings: dict[str, list[Request]] = {}  # group leader -> siblings waiting for the fork
        self._finished_unreported: list[Request] = []  # finished inside schedule(): next update_from_output
        self._clock = clock
        self._last_memory_log = clock()

    # ---- requests in and out -------------------------------------------------------------------------
    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already scheduled")
        if request.max_model_len is None:
            request.max_model_len = self.config.max_model_len
        p, limit = request.num_prompt_tokens, request.max_model_len
        if p == 0:
            raise RequestRejected("prompt is empty: at least 1 token is needed")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None and p >= limit:
            raise RequestRejected(f"prompt is {p} tokens >= max_model_len {limit}: no room for output tokens")
        if max_tokens is not None and p + max_tokens > limit:
            raise RequestRejected(f"prompt is {p} tokens + max_tokens {max_tokens} = {p + max_tokens} "
                                  f"> max_model_len {limit}")
        need = self.kv_cache_manager.num_blocks_for(request.num_tokens)
        if need > self.cache_config.num_blocks:
            raise RequestRejected(
                f"prompt needs {need} blocks ({request.num_tokens} tokens / block_size {self.block_size}), "
                f"the cache has {self.cache_config.num_blocks}"
            )

    def _already_done(self, request: Request) -> bool:
        """A resumed request whose sent tokens already end it: reported by the next update_from_output."""
        if not request.output_token_ids or not request.check_stop():
            return False
        self._finished_unreported.append(request)
        return True

    def add_request(self, request: Request) -> None:
        self._validate(request)
        if self._already_done(request):
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_request_group(self, requests: list[Request]) -> None:
        """n > 1 samples of one prompt: requests[0] computes prompt[:-1], then the others share its blocks."""
        if len(requests) == 1:
            self.add_request(requests[0])
            return
        prompt = requests[0].prompt_token_ids
        if any(r.prompt_token_ids != prompt for r in requests):
            raise ValueError("a request group must share one prompt")
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("a request group needs distinct request ids")
        if len(requests) > self.config.max_num_seqs:
            raise RequestRejected(f"n={len(requests)} sequences > max_num_seqs {self.config.max_num_seqs}")
        for r in requests:
            self._validate(r)
        requests = [r for r in requests if not self._already_done(r)]
        if len(prompt) == 1 or len(requests) < 2:  # nothing to share (a 1-token prompt is the last token)
            for r in requests:
                self.add_request(r)
            return
        leader, *siblings = requests
        self.add_request(leader)
        self._fork_point[leader.request_id] = len(prompt) - 1
        self._siblings[leader.request_id] = siblings
        for r in siblings:
            r.status = RequestStatus.WAITING
            self.requests[r.request_id] = r

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request from outside (stop string found, client gone). Unknown or finished id: no-op."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        request.finish(reason, stop_reason)
        self._release(request)

    def _release(self, request: Request) -> None:
        """Free a finished request's blocks and forget it."""
        rid = request.request_id
        self.kv_cache_manager.free(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for leader_id, siblings in list(self._siblings.items()):  # an unforked sibling leaves its group
            if request in siblings:
                siblings.remove(request)
                if not siblings:
                    del self._siblings[leader_id], self._fork_point[leader_id]
        if rid in self._siblings:  # a leader that ends before the fork: its siblings run on their own
            del self._fork_point[rid]
            self.waiting.extendleft(reversed(self._siblings.pop(rid)))
        del self.requests[rid]

    def _finish_in_schedule(self, request: Request, reason: str) -> None:
        request.finish(reason)
        self._release(request)
        self._finished_unreported.append(request)

    # ---- one step ------------------------------------------------------------------------------------
    def _token_limit(self, request: Request) -> int:
        return self._fork_point.get(request.request_id, request.num_tokens)

    def _outgrows_cache(self, request: Request) -> bool:
        return self.kv_cache_manager.num_blocks_for(request.num_tokens) > self.cache_config.num_blocks

    def _next_waiting(self) -> Request:
        request = self.policy.next_to_admit(self.waiting, self._clock())
        if request not in self.waiting:
            raise RuntimeError(f"scheduling policy {type(self.policy).__name__}.next_to_admit returned "
                               f"{getattr(request, 'request_id', request)!r}, which is not waiting")
        return request

    def _next_victim(self) -> Request:
        victim = self.policy.next_to_preempt(self.running, self._clock())
        if victim not in self.running:
            raise RuntimeError(f"scheduling policy {type(self.policy).__name__}.next_to_preempt returned "
                               f"{getattr(victim, 'request_id', victim)!r}, which is not running")
        return victim

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _fork(self, leader: Request) -> None:
        del self._fork_point[leader.request_id]
        for sibling in self._siblings.pop(leader.request_id):
            self.kv_cache_manager.fork(leader, sibling)
            sibling.num_computed_tokens = leader.num_computed_tokens
            sibling.num_cached_tokens = leader.num_cached_tokens
            sibling.status = RequestStatus.RUNNING
            self.running.append(sibling)

    def schedule(self) -> SchedulerOutput:
        self._maybe_log_memory()
        for leader_id in list(self._fork_point):  # leaders whose shared prefix was computed last step
            leader = self.requests[leader_id]
            if leader.status == RequestStatus.RUNNING and leader.num_computed_tokens >= self._fork_point[leader_id]:
                self._fork(leader)
        kvm, max_seqs = self.kv_cache_manager, self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request id -> tokens this step, in batch order
        preempted = False  # after a preemption nothing new is admitted this step

        for request in list(self.running):
            if budget <= 0 or len(scheduled) >= max_seqs:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(self._token_limit(request) - request.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            if self._outgrows_cache(request):
                self._finish_in_schedule(request, "length")
                continue
            while kvm.allocate_slots(request, num_new) is None:
                victim = self._next_victim()
                self._preempt(victim)
                preempted = True
                budget += scheduled.pop(victim.request_id, 0)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new

        while not preempted and self.waiting and budget > 0 and len(scheduled) < max_seqs:
            request = self._next_waiting()
            if len(self.running) + 1 + len(self._siblings.get(request.request_id, ())) > max_seqs:
                break
            if self._outgrows_cache(request):
                self.waiting.remove(request)
                self._finish_in_schedule(request, "length")
                continue
            hit_blocks, num_hit = kvm.get_computed_blocks(request)
            if request.prompt_logprobs is not None:  # a hit has no logits: only over positions scored already
                hit_blocks = hit_blocks[:max(0, request.scored_prompt_tokens - 1) // self.block_size]
                num_hit = len(hit_blocks) * self.block_size
            limit = self._token_limit(request)
            if num_hit > limit:  # a resumed group leader: stop the hit at the shared prefix
                hit_blocks = hit_blocks[: limit // self.block_size]
                num_hit = len(hit_blocks) * self.block_size
            num_new = min(limit - num_hit, budget)
            if kvm.allocate_slots(request, num_new, hit_blocks) is None:
                break  # head of line waits: no skipping ahead, so big requests cannot starve
            self.waiting.remove(request)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            if num_new > 0:
                scheduled[request.request_id] = num_new
                budget -= num_new
            if self._fork_point.get(request.request_id, -1) == num_hit:  # the hit covers the shared prefix
                self._fork(request)

        seqs = []
        for rid, num_new in scheduled.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            seqs.append(ScheduledSeq(
                request_id=rid, token_ids=request.token_ids(start, start + num_new), start_pos=start,
                block_table=kvm.get_block_ids(rid), slot_mapping=kvm.slot_mapping(rid, start, num_new),
                sample=start + num_new == request.num_tokens))
            if request.prompt_logprobs is not None:  # positions p < P - 1 predict prompt token p + 1
                end = min(start + num_new, request.num_prompt_tokens - 1)
                seqs[-1].prompt_logprob_targets = request.prompt_token_ids[start + 1:end + 1]
                seqs[-1].num_prompt_logprobs = request.prompt_logprobs
            request.num_computed_tokens = start + num_new
        return SchedulerOutput(seqs=seqs, blocks_to_copy=kvm.take_pending_copies())

    def update_from_output(self, sched_out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record the step's results: cache the now-written full blocks, append sampled tokens, finish.

        Returns the requests that finished (including any that schedule() ended because they outgrew
        the whole cache, finish_reason "length").
        """
        finished, self._finished_unreported = self._finished_unreported, []
        for seq in sched_out.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted after schedule()
            self.kv_cache_manager.cache_blocks(request, seq.context_len)
            if not seq.sample:
                continue
            if seq.request_id not in sampled:
                raise ValueError(f"no sampled token for request {seq.request_id!r} (its seq had sample=True)")
            request.append_output_token(sampled[seq.request_id])
            if request.check_stop():
                self._release(request)
                finished.append(request)
        return finished

    # ---- statistics ----------------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(**asdict(self.kv_cache_manager.stats()), num_running=len(self.running),
                              num_waiting=len(self.waiting) + sum(len(s) for s in self._siblings.values()),
                              num_preemptions=self.num_preemptions)

    def _maybe_log_memory(self) -> None:
        interval = self.config.log_memory_usage_s
        now = self._clock()
        if interval <= 0 or now - self._last_memory_log < interval:
            return
        self._last_memory_log = now
        s = self.stats()
        logger.info(
            "KV cache: %d/%d blocks used (%.1f%%), %d free, %d cached; fragmentation %d of %d slots; "
            "prefix cache hits %d/%d tokens; running %d, waiting %d; %d preemptions so far",
            s.used_blocks, s.total_blocks, 100.0 * s.usage, s.free_blocks, s.cached_blocks,
            s.fragmentation_slots, s.allocated_slots, s.prefix_cache_hits, s.prefix_cache_queries,
            s.num_running, s.num_waiting, s.num_preemptions,
        )
