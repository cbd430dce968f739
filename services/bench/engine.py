"""kvfleet's side of `kvfleet bench throughput`: the workload through LLMEngine in this process.

All requests are queued at once (offline, like the baselines' generate) and the engine steps until they are
done; KV-cache statistics are sampled after every step. Warm-up first (not timed): the worker's own
(gpu_worker.engine.warmup), as vLLM's start runs a forward of its largest step before it serves. With --rounds
the loaded engine runs the workload once per round, the prefix cache emptied between rounds
(services.bench.interleave).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from services.bench.metrics import KVWasteMeter, ModelShape, PeakRssSampler
from services.bench.sampling import sampling_args
from services.bench.workload import Workload
from shared.sampling_params import SamplingParams


def _params(output_len: int, sampling: dict | None = None) -> SamplingParams:
    return SamplingParams(**(sampling or {"temperature": 0.0}), max_tokens=output_len, min_tokens=output_len,
                          ignore_eos=True)


class EngineBench:
    """The engine loaded and warmed up once; then one timed round per `round()` call, each from an empty prefix
    cache (`kvfleet bench throughput --rounds`)."""

    def __init__(self, model_dir: Path, workload: Workload, shape: ModelShape, args: argparse.Namespace, *,
                 progress: bool) -> None:
        from gpu_worker.engine.llm_engine import LLMEngine
        from gpu_worker.engine.warmup import warm_up

        self.workload, self.shape, self.args, self.progress = workload, shape, args, progress
        self.tp = getattr(args, "tensor_parallel_size", 1)
        self.sampling = sampling_args(args)
        self.rss = PeakRssSampler(children=self.tp > 1).__enter__()  # with the executors' memory; ends in close()
        t0 = time.perf_counter()
        try:
            self.engine = engine = LLMEngine.from_model(
                str(model_dir), dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching, seed=0, tensor_parallel_size=self.tp,
                async_output=getattr(args, "async_output", False))
        except BaseException:
            self.rss.__exit__(None, None, None)
            raise
        self.load_s = time.perf_counter() - t0
        # warmed up as a worker is before it takes requests: a step of the engine's largest size on every forward
        # thread, the sampling paths, then a wait until the KV cache is resident (gpu_worker.executor.kv_prefault),
        # as vLLM's start runs a dummy forward of max_num_batched_tokens tokens and zeroes its cache. A smaller
        # warm-up (2 requests x 4 tokens) left the first full-size prefill steps of the first timed round to
        # fault their activations' memory in (2-core Zen 5, float32: the round 19.4 s, the next 17.5 s). Its
        # prompts are random ids: the workload's find none of them in the prefix cache.
        self.warmup = warm_up(engine)
        self.prefault_s = self.warmup.kv_wait_s
        print(f"kvfleet {self.warmup.describe()} (not timed)", file=sys.stderr, flush=True)
        self.rounds = 0

    def round(self, label: str = "kvfleet") -> dict:
        """The workload once, timed; the result of this round (peak RSS: so far)."""
        engine, workload, args = self.engine, self.workload, self.args
        if self.rounds:
            if not engine.reset_prefix_cache():
                raise RuntimeError("the previous round left requests behind: the prefix cache cannot be emptied")
        self.rounds += 1
        base = engine.stats()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=workload.output_tokens, desc=label, unit="tok", dynamic_ncols=True)
        profile = None
        if getattr(args, "profile_ops", False):
            from services.bench.op_profile import OpProfile

            profile = OpProfile().attach(engine)
        meter = KVWasteMeter()
        done: dict[str, tuple[int, int]] = {}  # request id -> (output tokens, prefix-cache hit tokens)
        produced: dict[str, int] = {}  # request id -> output tokens so far (the engine's outputs are deltas)
        steps = 0
        t1 = time.perf_counter()
        for r in workload.requests:
            engine.add_request(str(r.id), r.prompt_token_ids, _params(r.output_len, self.sampling))
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            s = engine.stats()
            meter.observe(s.used_blocks, s.allocated_slots, s.stored_tokens)
            new = 0
            for out in outputs:
                k = len(out.outputs[0].token_ids)
                new += k
                n = produced[out.request_id] = produced.get(out.request_id, 0) + k
                if out.finished:
                    done[out.request_id] = (n, out.metrics.num_cached_tokens if out.metrics else 0)
            if bar is not None:
                bar.update(new)
        wall = time.perf_counter() - t1
        if bar is not None:
            bar.close()
        end = engine.stats()
        if profile is not None:
            profile.detach()
        self.rss.sample()
        by_id = {str(r.id): r for r in workload.requests}
        wrong = [rid for rid, (n, _) in done.items() if n != by_id[rid].output_len]
        assert len(done) == len(by_id) and not wrong, f"requests {wrong[:5]} did not get exactly output_len tokens"
        n_out = sum(n for n, _ in done.values())
        cached = sum(c for _, c in done.values())
        flops = sum(self.shape.request_flops(len(by_id[rid].prompt_token_ids), n, c)
                    for rid, (n, c) in done.items())
        return {
            "system": "kvfleet", "dtype": args.dtype, "threads": args.threads, "tensor_parallel_size": self.tp,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size, "num_kv_blocks": end.total_blocks,
            "num_requests": len(done), "prompt_tokens": workload.prompt_tokens, "output_tokens": n_out,
            "load_s": round(self.load_s, 2), "kv_prefault_wait_s": round(self.prefault_s, 2),
            "wall_s": round(wall, 3), "steps": steps,
            "output_tok_per_s": n_out / wall, "total_tok_per_s": (workload.prompt_tokens + n_out) / wall,
            "peak_rss_bytes": self.rss.peak,
            "kv_peak_used_blocks": meter.peak_used_blocks, "kv_waste": meter.waste,
            "kv_peak_waste": meter.peak_waste, "kv_waste_samples": meter.samples,
            "preemptions": end.num_preemptions - base.num_preemptions,
            "prefix_cache_hit_tokens": cached,
            "model_flops": flops, "achieved_flops": flops / wall, "paths": engine.runner.paths(),
        } | ({"profile": profile.report()} if profile is not None else {})

    def close(self) -> None:
        self.engine.close()
        self.rss.__exit__(None, None, None)


def run_engine(model_dir: Path, workload: Workload, shape: ModelShape, args: argparse.Namespace, *,
               progress: bool) -> dict:
    """One round (the whole of kvfleet's side of `kvfleet bench throughput` without --rounds)."""
    bench = EngineBench(model_dir, workload, shape, args, progress=progress)
    try:
        return bench.round()
    finally:
        bench.close()
