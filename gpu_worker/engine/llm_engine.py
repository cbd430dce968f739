"""LLMEngine: add_request / abort_request / step(). A step is scheduler -> model runner -> sampler ->
scheduler.update_from_output -> detokenize -> stop strings -> one RequestOutput per request that moved.
Outputs are deltas (vLLM's RequestOutputKind.DELTA): the token ids, text and logprobs new since the request's
last output, so a step costs what it produced; the offline API (llm.py) folds them into complete outputs.
Tokens a request already had (resumed after a takeover, or recomputed after preemption) are never sent again.

Structured outputs (SamplingParams.structured_outputs): each sequence's grammar masks its logits before the
sampler and takes each sampled token (gpu_worker.engine.structured); a spec that does not compile is an
InvalidRequest.

A request with n > 1 runs as n sequences with ids f"{request_id}-{i}" (one scheduler group: they share the
prompt's blocks) and comes back as one RequestOutput with n CompletionOutputs.

Prompt logprobs (SamplingParams.prompt_logprobs): the runner scores the prompt's chunks as they are computed
(the scheduler names the targets). Prompts scored to the end leave their blocks' logprobs in ScoredPrefixes; a
new request takes those of its leading blocks from there, and the scheduler gives it a prefix-cache hit over
them (a hit has no logits). The request's first output with tokens carries the whole list once (in that
sample's CompletionOutput), entry 0 None (the first token has no context); a request resumed with tokens sent
had it sent already.

A failure that belongs to one request fails that request alone: its output is final with finish_reason
"error" and `error` set, its blocks are freed, and every other request of the step carries on as if nothing
happened. The forward and the sampler are isolated by gpu_worker.engine.isolation (bisection, row by row);
detokenizing, stop checks and output building run per request. add_request rejects what this model cannot
run (InvalidRequest: a token id outside the vocabulary, top_k above it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.kv_cache_manager import compute_block_hashes
from gpu_worker.core.policies import SchedulingPolicy
from gpu_worker.core.request import Request
from gpu_worker.core.sched_output import SchedulerOutput
from gpu_worker.core.scheduler import RequestRejected, Scheduler, SchedulerStats
from gpu_worker.engine import isolation, structured
from gpu_worker.engine.detokenizer import IncrementalDetokenizer, backend_decode
from gpu_worker.engine.isolation import EngineFault
from gpu_worker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gpu_worker.engine.sampler import Sampler, SamplingRow, draw_uniform
from gpu_worker.engine.scored_prefixes import ScoredPrefixes
from gpu_worker.engine.structured import Constraint, GrammarError, Grammars
from gpu_worker.executor.model_loader import checked_max_model_len, eos_token_ids, load_model_files
from gpu_worker.executor.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from shared.settings import Settings

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["EngineFault", "InvalidRequest", "LLMEngine", "RequestRejected"]


class InvalidRequest(RequestRejected):
    """A request no worker of this model can run (a field out of range): fail it, never hand it on."""


@dataclass
class _Sequence:
    """One of a request's n samples, with what the engine adds to the scheduler's Request."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    banned_ids: list[int]  # masked while fewer than min_tokens outputs exist
    num_seen: int  # output tokens already processed (detokenized, logprobs recorded)
    num_sent: int  # output tokens already in an output (or sent before a takeover)
    logprobs: list[dict[int, float]] | None  # of the processed tokens not sent yet; None if not asked
    cumulative_logprob: float | None
    constraint: Constraint | None = None  # structured outputs: its grammar's state


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by position (0: None); None: not asked
    prompt_logprob_ranks: list[int | None] | None = None  # the prompt tokens' ranks, by position
    prompt_logprobs_due: bool = False  # the next output with tokens carries them (once per request)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


@dataclass
class _Step:
    """A scheduled step until its forward is collected."""

    sched: SchedulerOutput
    sampling: list[_Sequence]  # its sequences that sample a token, in batch order
    forward: Future | None = None  # async_output: the forward running in the background


@dataclass
class _Collected:
    """A step after its sampler and scheduler update, before its outputs."""

    sampling: list[_Sequence]  # those that sampled (or failed to)
    failed: dict[str, str] = field(default_factory=dict)  # group request id -> why it failed
    invalid: set[str] = field(default_factory=set)  # of those, the ones failed by their own input (a 400, not a 500)
    logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)
    finished: list[Request] = field(default_factory=list)


class LLMEngine:
    """async_output: the output processing of step N (detokenizing, stop strings, the outputs, and what the caller
    does with them before the next step()) overlaps step N+1's forward, which runs on a thread of its own; each
    step() returns the outputs of the step before it. The scheduler still runs after step N's sampler, so a
    request ended by what only the output processing sees (a stop string, its grammar's end, an abort) is
    scheduled once more, and that token is dropped: the outputs are the same (vLLM v0's async output processing;
    its v1 async scheduling also moves the scheduler ahead of the sampler). Off: one step a call, in order."""

    def __init__(self, runner: ModelRunner, tokenizer, *, model_name: str, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, eos_token_ids: list[int], seed: int = 0, async_output: bool = False):
        self.runner = runner
        self.tokenizer = tokenizer
        self._decode = backend_decode(tokenizer)  # the detokenizers' decode, where it is transformers' own
        self.model_name = model_name
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._extra_eos_ids = eos_token_ids[1:]  # more end-of-text ids (Llama 3): treated as stop ids
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.sampler = Sampler(seed, device=runner.device)
        self._groups: dict[str, _Group] = {}
        self._seq_owner: dict[str, tuple[_Group, _Sequence]] = {}  # scheduler request id -> its group
        self.grammars = Grammars(tokenizer, runner.vocab_size, eos_token_ids)
        self.scored_prefixes = ScoredPrefixes(self.block_size) if cache_config.enable_prefix_caching else None
        self.async_output = async_output
        self._in_flight: _Step | None = None
        self._forward_thread = (ThreadPoolExecutor(1, thread_name_prefix="kvfleet-step", initializer=torch.set_num_threads,
                                                   initargs=(torch.get_num_threads(),)) if async_output else None)

    @classmethod
    def from_model(cls, model: str, *, dtype: str = "float32", device: str = "cpu", block_size: int = 16,
                   num_kv_blocks: int | None = None, kv_cache_memory: str | int | None = None,
                   max_num_seqs: int = 128, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                   enable_prefix_caching: bool = True, scheduling_policy: str | SchedulingPolicy = "fcfs",
                   seed: int = 0, log_memory_usage_s: float = 0.0, use_triton: bool | None = None,
                   tensor_parallel_size: int = 1, prefault_kv: bool | None = None,
                   async_output: bool = False) -> LLMEngine:
        """tensor_parallel_size N > 1: this process is rank 0 of N (gpu_worker.executor.tp_runner), the weights
        and KV heads split over N devices (GPUs) or N shares of this process's CPUs. prefault_kv: make the CPU
        KV cache resident in the background (gpu_worker.executor.kv_prefault); None: KVFLEET_KV_PREFAULT
        (default on)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        files = load_model_files(model)
        max_model_len = checked_max_model_len(files.config, max_model_len)
        sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    max_model_len=max_model_len, policy=scheduling_policy,
                                    log_memory_usage_s=log_memory_usage_s)
        runner_kwargs = dict(dtype=DTYPES[dtype], max_model_len=max_model_len, block_size=block_size,
                             num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                             use_triton=use_triton,
                             prefault_kv=Settings.from_env().kv_prefault if prefault_kv is None else prefault_kv)
        if tensor_parallel_size > 1:
            from gpu_worker.executor.tp_runner import TensorParallelRunner

            runner = TensorParallelRunner.start(model, tensor_parallel_size, device=device,
                                                max_num_batched_tokens=max_num_batched_tokens, **runner_kwargs)
        else:
            runner = ModelRunner(files, device=torch.device(device), **runner_kwargs)
        cache_cfg = CacheConfig(block_size=block_size, num_blocks=runner.num_blocks,
                                enable_prefix_caching=enable_prefix_caching)
        return cls(runner, files.tokenizer, model_name=str(model), scheduler_config=sched_cfg,
                   cache_config=cache_cfg, eos_token_ids=eos_token_ids(files.config, files.tokenizer), seed=seed,
                   async_output=async_output)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, prompt: str | None = None,
                    resume_output_token_ids: list[list[int]] | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request (raises RequestRejected when it can never run here). resume_output_token_ids:
        per sample, the tokens already sent before a worker died; they are recomputed, not sampled again."""
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already running")
        self._check(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        resume = resume_output_token_ids or []
        group = _Group(request_id, prompt, list(prompt_token_ids), metrics=RequestMetrics(arrival))
        for i in range(params.n):
            group.seqs.append(self._make_sequence(group, i, params, priority, arrival,
                                                  resume[i] if i < len(resume) else []))
        if params.prompt_logprobs is not None and not any(resume):  # else they went out with the first tokens
            group.prompt_logprobs_due = True
            group.prompt_logprobs = [None] * len(prompt_token_ids)
            group.prompt_logprob_ranks = [None] * len(prompt_token_ids)
            known = 1  # positions whose logprobs are known from the start: the first has none (no context)
            if self.scored_prefixes is not None:
                hashes = compute_block_hashes(prompt_token_ids, self.block_size)
                for s in group.seqs:  # the KV cache manager's prefix lookup extends these: hashed once
                    s.request.block_hashes = list(hashes)
                known = max(known, self.scored_prefixes.fill(prompt_token_ids, hashes, params.prompt_logprobs,
                                                             group.prompt_logprobs, group.prompt_logprob_ranks))
            if known < len(prompt_token_ids):  # a 1-token prompt has nothing to score
                for s in group.seqs:  # any of them may compute the prompt (the leader, or one after a preemption)
                    s.request.prompt_logprobs = params.prompt_logprobs
                    s.request.scored_prompt_tokens = known
        requests = [s.request for s in group.seqs]
        if len(requests) == 1:
            self.scheduler.add_request(requests[0])
        else:
            self.scheduler.add_request_group(requests)
        self._groups[request_id] = group
        for s in group.seqs:
            self._seq_owner[s.request.request_id] = (group, s)

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What the engine needs beyond SamplingParams' own checks: token ids in this model's vocabulary and
        top_k up to it (the producer may have skipped the gateway's validation)."""
        vocab = self.runner.vocab_size

        def outside(ids: Any) -> Any:
            return next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)

        if (bad := outside(prompt_token_ids)) is not None:
            raise InvalidRequest(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if (bad := outside(params.stop_token_ids)) is not None:
            raise InvalidRequest(f"stop_token_ids: {bad!r} is outside the vocabulary [0, {vocab})")
        if (bad := outside(params.logit_bias or {})) is not None:  # SamplingParams made the keys ints
            raise InvalidRequest(f"logit_bias: key {bad!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(params.top_k, int) or not 0 <= params.top_k <= vocab:
            raise InvalidRequest(f"top_k must be -1 (off) or in [1, {vocab}] (the vocabulary), got {params.top_k!r}")
        if params.structured_outputs is not None:
            try:
                self.grammars.compile(params.structured_outputs)
            except GrammarError as e:
                raise InvalidRequest(str(e)) from None

    def _make_sequence(self, group: _Group, index: int, params: SamplingParams, priority: int, arrival: float,
                       resumed: list[int]) -> _Sequence:
        sp = params
        if params.n > 1 or self._extra_eos_ids:
            sp = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index,
                                     stop_token_ids=params.stop_token_ids + [
                                         e for e in self._extra_eos_ids if not params.ignore_eos])
        rid = group.request_id if params.n == 1 else f"{group.request_id}-{index}"
        request = Request(rid, group.prompt_token_ids, sp, eos_token_id=self.eos_token_id, priority=priority,
                          arrival_time=arrival, output_token_ids=list(resumed))
        generator = None
        if sp.seed is not None and not sp.greedy:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(sp.seed)
            for _ in resumed:  # the draws those tokens took, so the continuation is the same
                draw_uniform(generator, 1, self.runner.device)
        banned = list(sp.stop_token_ids)
        if self.eos_token_id is not None and not sp.ignore_eos:
            banned.append(self.eos_token_id)
        detok = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                       skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
                                       include_stop_str_in_output=sp.include_stop_str_in_output,
                                       decode=self._decode)
        if resumed:  # their text was sent too: all of it but what a stop string could still begin with
            detok.add_tokens(resumed)
            detok.take_text(finished=False)
        want_lp = sp.logprobs is not None
        constraint = None
        if sp.structured_outputs is not None:
            try:
                constraint = Constraint(self.grammars.compile(sp.structured_outputs), resumed)
            except GrammarError as e:
                raise InvalidRequest(str(e)) from None
        return _Sequence(index, request, detok, generator, banned, num_seen=len(resumed), num_sent=len(resumed),
                         logprobs=[] if want_lp else None, cumulative_logprob=0.0 if want_lp else None,
                         constraint=constraint)

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its samples) and free its blocks; unknown or finished id: no-op."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for s in group.seqs:
            self.scheduler.abort_request(s.request.request_id)
            self._seq_owner.pop(s.request.request_id, None)

    def fault(self) -> str | None:
        """Why the engine cannot go on although no step failed yet (a tensor-parallel rank died), or None."""
        return self.runner.fault()

    def wait_kv_resident(self) -> float:
        """Block until the runner's KV cache is resident (on CPU it is pre-faulted in the background from the
        runner's start: gpu_worker.executor.kv_prefault); the seconds waited. A runner without one (CUDA,
        tensor-parallel, simulated): 0 at once."""
        prefault = getattr(self.runner, "kv_prefault", None)
        if prefault is None or prefault.done:
            return 0.0
        start = time.perf_counter()
        log.info("waiting for the KV cache to be resident (%d of %d blocks so far)", prefault.blocks_done,
                 prefault.num_blocks)
        prefault.wait()
        return time.perf_counter() - start

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (and the prompt logprobs kept by prefix block), as vLLM's
        `LLM.reset_prefix_cache`: no later request hits what ran before. Only between requests: False, and
        nothing forgotten, while a request is unfinished."""
        if self.has_unfinished_requests():
            return False
        self._settle()  # a forward in flight may still write to blocks the reset hands out again
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            return False
        if self.scored_prefixes is not None:
            self.scored_prefixes = ScoredPrefixes(self.block_size, self.scored_prefixes.capacity)
        return True

    def close(self) -> None:
        """Stop the runner's threads and processes (a tensor-parallel runner's executors). Idempotent."""
        self._settle()
        if self._forward_thread is not None:
            self._forward_thread.shutdown()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. A request whose forward, sampling, detokenizing or output fails ends here with
        finish_reason "error"; EngineFault when the forward fails for every request (the worker is broken).

        With async_output, the step's forward runs in the background and the call returns the outputs of the
        step before it, processed meanwhile (see the class docstring)."""
        if not self.async_output:
            return self._outputs(self._collect(self._schedule(), None))
        step, self._in_flight = self._in_flight, None
        done = self._collect(step, step.forward.result()) if step is not None else None
        step = self._schedule()
        if step.sched.seqs or step.sched.blocks_to_copy:
            step.forward = self._forward_thread.submit(isolation.execute, self.runner.execute, step.sched)
            self._in_flight = step
            step = None
        outputs = self._outputs(done) if done is not None else []
        if step is not None:  # nothing to run: what schedule() ended (outgrew the cache) is reported now
            outputs += self._outputs(self._collect(step, None))
        return outputs

    def _settle(self) -> None:
        """Wait for a forward in flight (async_output) and drop its results: every request it ran has ended
        (has_unfinished_requests() is False, or the engine is closing)."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            try:
                step.forward.result()
            except Exception:  # noqa: BLE001 (no request is left to fail with it)
                log.exception("the forward in flight failed after its requests ended")

    def _schedule(self) -> _Step:
        sched = self.scheduler.schedule()
        now = time.monotonic()
        sampling: list[_Sequence] = []
        for seq in sched.seqs:
            group, s = self._seq_owner[seq.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                group.metrics.num_cached_tokens = s.request.num_cached_tokens
            if seq.sample:
                sampling.append(s)
        return _Step(sched, sampling)

    def _live(self, s: _Sequence) -> bool:
        """Whether a sequence scheduled for a step still runs when its forward is done: with async_output, a
        stop string found in the step before, an abort or a grammar's end may have ended it meanwhile (its token
        from this step is dropped, as vLLM's async scheduling drops it)."""
        owner = self._seq_owner.get(s.request.request_id)
        return owner is not None and owner[1] is s and not s.request.is_finished

    def _collect(self, step: _Step, forward: tuple[torch.Tensor | None, dict[str, str]] | None) -> _Collected:
        """The step's forward (run here when `forward` is None and the step has work), grammars, sampler and
        scheduler update."""
        sched, done = step.sched, _Collected(step.sampling)
        logits = None
        if forward is None and (sched.seqs or sched.blocks_to_copy):
            forward = isolation.execute(self.runner.execute, sched)
        if forward is not None:
            logits, culprits = forward  # [len(sampling) - culprits, V]
            for rid in culprits:
                if (owner := self._seq_owner.get(rid)) is not None:
                    done.failed.setdefault(owner[0].request_id, f"the model failed on it: {culprits[rid]}")
            done.sampling = [s for s in done.sampling if s.request.request_id not in culprits]
            if any(seq.prompt_logprob_targets for seq in sched.seqs):
                self._record_prompt_logprobs()
        if self.async_output and not all(self._live(s) for s in done.sampling):
            keep = [i for i, s in enumerate(done.sampling) if self._live(s)]
            done.sampling = [done.sampling[i] for i in keep]
            logits = logits[keep] if logits is not None else None
        sampling, failed = done.sampling, done.failed
        complete: set[str] = set()  # sequences whose grammar is complete with no stop token left to sample
        sampled: dict[str, int] = {}
        if sampling and any(s.constraint is not None for s in sampling):
            complete = self._apply_grammars(sampling, logits, failed, done.invalid)
        if sampling:
            # min_tokens bans the stop ids while the output is short, but not under a grammar: when it is complete
            # its stop token is the only one it allows (the fuzz tier found the 500 of that clash)
            rows = [SamplingRow(s.request.sampling_params, s.request.prompt_token_ids, s.request.output_token_ids,
                                s.banned_ids if s.request.num_output_tokens < s.request.sampling_params.min_tokens
                                and s.constraint is None else [], s.generator) for s in sampling]
            out, row_errors = isolation.sample(self.sampler, logits, rows)
            for i, (s, tok, lp) in enumerate(zip(sampling, out.token_ids, out.logprobs, strict=True)):
                if s.request.request_id in complete:
                    continue
                if i in row_errors:
                    failed.setdefault(self._seq_owner[s.request.request_id][0].request_id,
                                      f"sampling failed: {row_errors[i]}")
                else:
                    sampled[s.request.request_id] = tok
                    done.logprobs[s.request.request_id] = lp
                    if s.constraint is not None and self._seq_owner[s.request.request_id][0].request_id not in failed:
                        try:
                            s.constraint.accept(tok)
                        except GrammarError as e:
                            failed.setdefault(self._seq_owner[s.request.request_id][0].request_id, str(e))
        for rid in failed:  # before update_from_output, which skips what is no longer running
            self._abort_seqs(self._groups[rid])
        for rid in complete:
            self.scheduler.finish_request(rid, "stop")
        done.finished = self.scheduler.update_from_output(sched, sampled)
        return done

    def _outputs(self, done: _Collected) -> list[RequestOutput]:
        """Detokenize the step's new tokens, check stop strings, and build one output per request that moved."""
        failed = done.failed
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for s in done.sampling:
            group = self._seq_owner[s.request.request_id][0]
            touched[group.request_id] = group
            if group.request_id in failed:
                continue
            try:
                self._process_new_tokens(s, done.logprobs.get(s.request.request_id))
                if s.constraint is not None and s.constraint.done and not s.request.is_finished:
                    self.scheduler.finish_request(s.request.request_id, "stop")  # the grammar is complete
            except Exception as e:  # noqa: BLE001 (this request's detokenizer or stop check)
                failed[group.request_id] = f"detokenizing failed: {isolation.describe(e)}"
                self._abort_seqs(group)
                continue
            if group.metrics.first_token_time is None and s.request.num_output_tokens > 0:
                group.metrics.first_token_time = now
        for request in done.finished:
            owner = self._seq_owner.get(request.request_id)
            if owner is not None:
                touched[owner[0].request_id] = owner[0]
        for rid in failed:
            touched[rid] = self._groups[rid]
        outputs = []
        for group in touched.values():
            if group.request_id not in self._groups:
                continue  # aborted during the step
            if group.request_id not in failed:
                try:
                    outputs.append(self._finish_step(group, now))
                    continue
                except Exception as e:  # noqa: BLE001 (this request's output)
                    failed[group.request_id] = f"building its output failed: {isolation.describe(e)}"
            outputs.append(self._fail(group, failed[group.request_id], now,
                                      "invalid_request" if group.request_id in done.invalid else "internal"))
        return outputs

    def _finish_step(self, group: _Group, now: float) -> RequestOutput:
        output = self._output(group, group.finished)
        if output.finished:
            group.metrics.finished_time = now
            output.metrics = dataclasses.replace(group.metrics)
            self._forget(group)
        return output

    def _abort_seqs(self, group: _Group) -> None:
        for s in group.seqs:
            self.scheduler.abort_request(s.request.request_id)

    def _forget(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for s in group.seqs:
            self._seq_owner.pop(s.request.request_id, None)

    def _fail(self, group: _Group, error: str, now: float, kind: str = "internal") -> RequestOutput:
        """End a request whose own work failed: blocks freed, a final output with finish_reason "error". kind:
        "invalid_request" when its input is at fault (a grammar with a dead end), else "internal"."""
        log.error("request %s failed: %s", group.request_id, error)
        self._abort_seqs(group)
        self._forget(group)
        group.metrics.finished_time = now
        outs = [CompletionOutput(index=s.index, text="", token_ids=[], logprobs=None, finish_reason="error",
                                 cumulative_logprob=s.cumulative_logprob) for s in group.seqs]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, True,
                             dataclasses.replace(group.metrics), error=error, error_kind=kind)

    def _apply_grammars(self, sampling: list[_Sequence], logits: torch.Tensor, failed: dict[str, str],
                        invalid: set[str]) -> set[str]:
        """Mask each constrained row of `logits` by its grammar, before the sampler. -> the sequences whose grammar
        is complete with no stop token left to sample (they end with "stop"); a dead end or a grammar that
        failed goes into `failed` and `invalid` (the request's own input is at fault)."""
        complete = set()
        rows = [(i, s.constraint) for i, s in enumerate(sampling) if s.constraint is not None]
        for i, why in structured.mask(logits, rows).items():
            rid = sampling[i].request.request_id
            if why is None:
                complete.add(rid)
            else:
                failed.setdefault(self._seq_owner[rid][0].request_id, why)
                invalid.add(self._seq_owner[rid][0].request_id)
        return complete

    def _record_prompt_logprobs(self) -> None:
        """The prompt logprobs the step's forwards scored, into their groups; a group with all of them stops
        asking the scheduler for more (its requests may use the prefix cache again after a preemption)."""
        for rid, scored in self.runner.take_prompt_logprobs().items():
            owner = self._seq_owner.get(rid)
            group = owner[0] if owner is not None else None
            if group is None or group.prompt_logprobs is None:
                continue
            for position, (entry, rank) in enumerate(zip(scored.entries, scored.ranks, strict=True),
                                                     scored.first_position):
                group.prompt_logprobs[position], group.prompt_logprob_ranks[position] = entry, rank
            entries, lead = group.prompt_logprobs, group.seqs[0].request
            known = max(1, lead.scored_prompt_tokens)  # positions before it are known already: go on from there
            while known < len(entries) and entries[known] is not None:
                known += 1
            for s in group.seqs:
                s.request.scored_prompt_tokens = known  # a preempted one may take a hit up to there
            if known == len(entries):
                top_n = lead.prompt_logprobs
                for s in group.seqs:
                    s.request.prompt_logprobs = None
                if self.scored_prefixes is not None and top_n is not None:
                    full = len(group.prompt_token_ids) // self.block_size  # the prompt's blocks, not the output's
                    self.scored_prefixes.keep(group.prompt_token_ids, lead.block_hashes[:full], top_n, entries,
                                              group.prompt_logprob_ranks)

    def _process_new_tokens(self, s: _Sequence, logprob: dict[int, float] | None) -> None:
        request = s.request
        new = request.output_token_ids[s.num_seen:]
        if not new:
            return  # aborted or preempted between schedule and update
        s.num_seen = request.num_output_tokens
        if s.logprobs is not None and logprob is not None:
            s.logprobs.append(logprob)
            s.cumulative_logprob += logprob[new[-1]]
        sp = request.sampling_params
        stopped_by_token = request.finish_reason == "stop" and isinstance(request.stop_reason, int | None)
        if stopped_by_token and not sp.include_stop_str_in_output:
            new = new[:-1]  # eos / stop id: not part of the text
        stop = s.detok.add_tokens(new) if new else None
        if stop is not None:
            if request.is_finished:
                request.finish("stop", stop)  # the stop string wins over length
            else:
                self.scheduler.finish_request(request.request_id, "stop", stop)

    def _output(self, group: _Group, finished: bool) -> RequestOutput:
        """The group's delta: per sample, what was processed since its last output."""
        outs = []
        for s in group.seqs:
            r = s.request
            new_ids = r.output_token_ids[s.num_sent:s.num_seen]
            s.num_sent = s.num_seen
            logprobs = s.logprobs
            if logprobs is not None:
                s.logprobs = []
            prompt_logprobs = prompt_ranks = None
            if group.prompt_logprobs_due and new_ids:
                prompt_logprobs, prompt_ranks = group.prompt_logprobs, group.prompt_logprob_ranks
                group.prompt_logprobs_due = False
            outs.append(CompletionOutput(
                index=s.index, text=s.detok.take_text(r.is_finished), token_ids=new_ids, logprobs=logprobs,
                finish_reason=r.finish_reason, stop_reason=r.stop_reason, cumulative_logprob=s.cumulative_logprob,
                prompt_logprobs=prompt_logprobs, prompt_logprob_ranks=prompt_ranks))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                             dataclasses.replace(group.metrics))
