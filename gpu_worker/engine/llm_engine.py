"""LLMEngine: add_request / abort_request / step(). A step is scheduler -> model runner -> sampler ->
scheduler.update_from_output -> detokenize -> stop strings -> one RequestOutput per request that moved.
Outputs are deltas (vLLM's RequestOutputKind.DELTA): the token ids, text and logprobs new since the request's
last output, so a step costs what it produced; the offline API (llm.py) folds them into complete outputs.
The input processor checks a request and makes its state (gpu_worker.engine.input_processor); that state turns
the step's tokens into the request's delta (gpu_worker.engine.request_state).

Structured outputs (SamplingParams.structured_outputs): each sequence's grammar masks its logits before the
sampler and takes each sampled token (gpu_worker.engine.structured).

A request with n > 1 runs as n sequences with ids f"{request_id}-{i}" (one scheduler group: they share the
prompt's blocks) and comes back as one RequestOutput with n CompletionOutputs.

Prompt logprobs (SamplingParams.prompt_logprobs): the runner scores the prompt's chunks as they are computed
(the scheduler names the targets). Prompts scored to the end leave their blocks' logprobs in ScoredPrefixes; a
new request takes those of its leading blocks from there, and the scheduler gives it a prefix-cache hit over
them (a hit has no logits). The request's first output with tokens carries the whole list once.

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

import torch

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.policies import SchedulingPolicy
from gpu_worker.core.request import Request
from gpu_worker.core.sched_output import SchedulerOutput
from gpu_worker.core.scheduler import RequestRejected, Scheduler, SchedulerStats
from gpu_worker.engine import isolation, structured
from gpu_worker.engine.input_processor import InputProcessor, InvalidRequest
from gpu_worker.engine.isolation import EngineFault
from gpu_worker.engine.outputs import RequestOutput
from gpu_worker.engine.request_state import RequestState, SequenceState
from gpu_worker.engine.sampler import Sampler, SamplingRow
from gpu_worker.engine.scored_prefixes import ScoredPrefixes
from gpu_worker.engine.structured import GrammarError
from gpu_worker.executor.model_loader import checked_max_model_len, eos_token_ids, load_model_files
from gpu_worker.executor.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from shared.settings import Settings

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["EngineFault", "InvalidRequest", "LLMEngine", "RequestRejected"]


@dataclass
class _Step:
    """A scheduled step until its forward is collected."""

    sched: SchedulerOutput
    sampling: list[SequenceState]  # its sequences that sample a token, in batch order
    forward: Future | None = None  # async_output: the forward running in the background


@dataclass
class _Collected:
    """A step after its sampler and scheduler update, before its outputs."""

    sampling: list[SequenceState]  # those that sampled (or failed to)
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
        self.model_name = model_name
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self.sampler = Sampler(seed, device=runner.device)
        self._groups: dict[str, RequestState] = {}
        self._seq_owner: dict[str, tuple[RequestState, SequenceState]] = {}  # scheduler request id -> its group
        self.inputs = InputProcessor(tokenizer, runner.vocab_size, eos_token_ids, runner.device)
        self.grammars = self.inputs.grammars
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
        arrival = time.monotonic() if arrival_time is None else arrival_time
        resume = resume_output_token_ids or []
        group = self.inputs.new_request(request_id, prompt, prompt_token_ids, params, priority, arrival, resume)
        if params.prompt_logprobs is not None and not any(resume):  # else they went out with the first tokens
            group.ask_prompt_logprobs(params.prompt_logprobs, self.scored_prefixes, self.block_size)
        requests = [s.request for s in group.seqs]
        if len(requests) == 1:
            self.scheduler.add_request(requests[0])
        else:
            self.scheduler.add_request_group(requests)
        self._groups[request_id] = group
        for s in group.seqs:
            self._seq_owner[s.request.request_id] = (group, s)

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
        sampling: list[SequenceState] = []
        for seq in sched.seqs:
            group, s = self._seq_owner[seq.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                group.metrics.num_cached_tokens = s.request.num_cached_tokens
            if seq.sample:
                sampling.append(s)
        return _Step(sched, sampling)

    def _live(self, s: SequenceState) -> bool:
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
        touched: dict[str, RequestState] = {}
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

    def _finish_step(self, group: RequestState, now: float) -> RequestOutput:
        output = group.delta(group.finished)
        if output.finished:
            group.metrics.finished_time = now
            output.metrics = dataclasses.replace(group.metrics)
            self._forget(group)
        return output

    def _abort_seqs(self, group: RequestState) -> None:
        for s in group.seqs:
            self.scheduler.abort_request(s.request.request_id)

    def _forget(self, group: RequestState) -> None:
        del self._groups[group.request_id]
        for s in group.seqs:
            self._seq_owner.pop(s.request.request_id, None)

    def _fail(self, group: RequestState, error: str, now: float, kind: str = "internal") -> RequestOutput:
        """End a request whose own work failed: blocks freed, a final output with finish_reason "error". kind:
        "invalid_request" when its input is at fault (a grammar with a dead end), else "internal"."""
        log.error("request %s failed: %s", group.request_id, error)
        self._abort_seqs(group)
        self._forget(group)
        group.metrics.finished_time = now
        return group.failed(error, kind)

    def _apply_grammars(self, sampling: list[SequenceState], logits: torch.Tensor, failed: dict[str, str],
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
        """The prompt logprobs the step's forwards scored, into their requests; those scored to the end are kept by
        prefix block for later requests."""
        for rid, scored in self.runner.take_prompt_logprobs().items():
            owner = self._seq_owner.get(rid)
            group = owner[0] if owner is not None else None
            if group is None or group.prompt_logprobs is None:
                continue
            top_n = group.add_scored_prompt(scored)
            if top_n is not None and self.scored_prefixes is not None:
                full = len(group.prompt_token_ids) // self.block_size  # the prompt's blocks, not the output's
                self.scored_prefixes.keep(group.prompt_token_ids, group.seqs[0].request.block_hashes[:full], top_n,
                                          group.prompt_logprobs, group.prompt_logprob_ranks)

    def _process_new_tokens(self, s: SequenceState, logprob: dict[int, float] | None) -> None:
        stop = s.process_new_tokens(logprob)
        if stop is not None:
            if s.request.is_finished:
                s.request.finish("stop", stop)  # the stop string wins over length
            else:
                self.scheduler.finish_request(s.request.request_id, "stop", stop)
