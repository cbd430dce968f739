"""`kvfleet bench calibrate`: fit a simulated worker's cost profile (gpu_worker.executor.cost_model) on the real
engine here.

It runs the real engine (LLMEngine.from_model, prefix caching off, so every prompt token is computed) over a
designed set of requests: single prompts of 32..1024 tokens (prefill-only steps), batches of 1..64 requests
with contexts of 64..768 tokens (their chunked prefills, the mixed steps where the first ones decode while
the last ones prefill, then pure decode steps). It times every engine step (scheduler, forward, sampler,
detokenizer: what a step of a worker costs) with the step's shape, and fits
    seconds = a + b * prefill_tokens + c * decode_seqs + d * context_tokens + e * prefill_pairs
by non-negative least squares of the relative error (every subset of the five terms, the best fit with no
negative coefficient; gpu_worker.executor.cost_model says what each term counts). It prints the fit (r2, mean relative error, per kind of step) and writes the profile.

On a busy machine the wall clock counts the time a step waited for a core: `--threads 1 --clock cpu` times
each step by the process's CPU time instead (the shipped smollm2-cpu profile was made so).

`--from-steps FILE` fits on the steps a real worker ran under load instead (`kvfleet worker --step-log FILE`):
what its steps cost where it runs, with the mixes of prefill chunks, prefix-cache hits and decodes its load made.
"""

from __future__ import annotations

import datetime
import itertools
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpu_worker.executor.cost_model import CostProfile, StepShape, StepShapes
from services.bench.cpu import describe

# (requests, prompt tokens, output tokens): prefills of one prompt, then batches that decode. About 28k prompt
# tokens in all, so the default run of a small model stays near two minutes on two cores.
PREFILL_CASES = [(1, n, 1) for n in (32, 128, 512, 1024)] + [(2, 512, 1)]
DECODE_CASES = [(1, 64, 16), (1, 768, 16), (8, 64, 12), (8, 384, 12), (32, 64, 10), (32, 192, 8), (64, 64, 8),
                (16, 512, 8)]
QUICK_CASES = [(1, 32, 1), (1, 256, 1), (2, 64, 4), (8, 64, 4)]  # --quick: a smoke run of a few seconds


@dataclass
class Sample:
    shape: StepShape
    seconds: float

    @property
    def kind(self) -> str:
        if self.shape.prefill_tokens and self.shape.decode_seqs:
            return "mixed"
        return "prefill" if self.shape.prefill_tokens else "decode"


@dataclass
class Fit:
    coefficients: tuple[float, ...]  # a, b, c, d, e
    r2: float
    mean_rel_error: float
    rel_error_by_kind: dict[str, float]


def design_matrix(samples: list[Sample]) -> Any:
    import numpy as np

    return np.array([[1.0, s.shape.prefill_tokens, s.shape.decode_seqs, s.shape.context_tokens, s.shape.prefill_pairs]
                     for s in samples])


def fit_nonnegative(samples: list[Sample]) -> Fit:
    """Least squares of the relative error (each step weighted by 1 / its time, so the many short decode steps
    count as much as the long prefills) with a, b, c, d, e >= 0: every subset of the terms fitted freely, the
    best whose coefficients are all >= 0 kept (exact for five terms, and simpler than an iterative NNLS)."""
    import numpy as np

    x, y = design_matrix(samples), np.array([s.seconds for s in samples])
    terms = x.shape[1]
    if len(samples) < terms:
        raise ValueError(f"calibration needs at least {terms} timed steps, got {len(samples)}")
    xw = x / y[:, None]  # rows scaled so that the target is 1: the residuals are relative errors
    best: tuple[float, Any] | None = None
    for k in range(1, terms + 1):
        for cols in itertools.combinations(range(terms), k):
            coef, *_ = np.linalg.lstsq(xw[:, cols], np.ones(len(y)), rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(terms)
            full[list(cols)] = coef
            residual = float(((xw @ full - 1.0) ** 2).sum())
            if best is None or residual < best[0]:
                best = (residual, full)
    assert best is not None  # the constant alone is never negative: its fit is a mean of positive ratios
    coef = best[1]
    predicted = x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    residual = float(((predicted - y) ** 2).sum())
    rel = np.abs(predicted - y) / y
    by_kind = {kind: float(rel[[i for i, s in enumerate(samples) if s.kind == kind]].mean())
               for kind in ("prefill", "decode", "mixed") if any(s.kind == kind for s in samples)}
    return Fit(tuple(float(c) for c in coef), 1.0 - residual / total if total > 0 else 1.0, float(rel.mean()), by_kind)


def measure(engine: Any, cases: list[tuple[int, int, int]], vocab: int, progress: bool,
            clock: Any = time.perf_counter) -> list[Sample]:
    """Run each case (requests added at once, stepped until all finish) and time each step that ran a forward
    with `clock` (wall time, or the process's CPU time)."""
    from shared.sampling_params import SamplingParams

    shapes = StepShapes(engine.runner)
    rng = random.Random(0)
    samples: list[Sample] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(n * (p + o) for n, p, o in cases), desc="calibrating", unit="tok", dynamic_ncols=True,
                   file=sys.stderr)
    try:
        for case, (n, prompt_len, max_tokens) in enumerate(cases):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for i in range(n):
                engine.add_request(f"cal-{case}-{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], params)
            while engine.has_unfinished_requests():
                start = clock()
                engine.step()
                seconds = clock() - start
                if (shape := shapes.take()) is not None:
                    samples.append(Sample(shape, seconds))
                    if bar is not None:
                        bar.update(shape.prefill_tokens + shape.decode_seqs)
    finally:
        shapes.close()
        if bar is not None:
            bar.close()
    return samples


def calibrate(model: str, *, dtype: str = "float32", name: str | None = None, quick: bool = False,
              cpu_clock: bool = False, progress: bool = True) -> tuple[CostProfile, Fit, list[Sample]]:
    """Time the real engine on the designed steps and fit a profile of it. cpu_clock: time steps by the process's
    CPU time (one torch thread only), which a busy machine does not inflate."""
    import torch

    from gpu_worker.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_model(model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=128,
                                  max_num_batched_tokens=2048)
    engine.wait_kv_resident()  # no page faults in the timed steps, as in a worker after its warm-up
    vocab = engine.runner.vocab_size
    measure(engine, [(2, 64, 4)], vocab, progress=False)  # warm-up: one-time costs stay out of the fit
    samples = measure(engine, QUICK_CASES if quick else PREFILL_CASES + DECODE_CASES, vocab, progress,
                      clock=time.process_time if cpu_clock else time.perf_counter)
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) and not cpu_clock:
        print(f"warning: the machine was busy (load average {load:.1f} on {os.cpu_count()} CPUs): the steps waited "
              "for the CPU, so the profile is slower than this machine is; calibrate again when it is idle, "
              "or with --threads 1 --clock cpu",
              file=sys.stderr)
    fit = fit_nonnegative(samples)
    a, b, c, d, e = fit.coefficients
    cfg = engine.scheduler.config
    profile = CostProfile(
        name=name or f"{Path(str(model)).stem}-cpu", a_s=a, b_s_per_prefill_token=b, c_s_per_decode_seq=c,
        d_s_per_context_token=d, e_s_per_prefill_pair=e, num_kv_blocks=engine.runner.num_blocks, block_size=engine.block_size,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        source=(f"calibrated: {model} {dtype} on {describe()}, {torch.get_num_threads()} torch thread(s), "
                f"{'CPU-time' if cpu_clock else 'wall'} clock, "
                f"{datetime.date.today().isoformat()} (`kvfleet bench calibrate`, {len(samples)} steps, load "
                f"average {load:.1f} after)"),
        fit={"r2": round(fit.r2, 4), "mean_rel_error": round(fit.mean_rel_error, 4), "steps": len(samples),
             **{f"mean_rel_error_{k}": round(v, 4) for k, v in fit.rel_error_by_kind.items()}})
    return profile, fit, samples


def report(profile: CostProfile, fit: Fit, samples: list[Sample]) -> str:
    lines = [f"profile {profile.name}: {profile.source}",
             f"  a = {profile.a_s * 1e3:.3f} ms per step",
             f"  b = {profile.b_s_per_prefill_token * 1e6:.2f} us per prefill token",
             f"  c = {profile.c_s_per_decode_seq * 1e6:.2f} us per decode sequence",
             f"  d = {profile.d_s_per_context_token * 1e9:.2f} ns per context token",
             f"  e = {profile.e_s_per_prefill_pair * 1e9:.3f} ns per prefill (query, key) pair",
             f"  fit over {len(samples)} steps: r2 {fit.r2:.4f}, mean relative error {fit.mean_rel_error:.1%} ("
             + ", ".join(f"{k} {v:.1%} over {sum(s.kind == k for s in samples)}"
                         for k, v in fit.rel_error_by_kind.items()) + ")"]
    return "\n".join(lines)


def add_arguments(sub: Any) -> None:
    """The `calibrate` subcommand of `kvfleet bench`."""
    import argparse

    p = sub.add_parser("calibrate", help="fit a simulated worker's cost profile on the real engine here",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="alias, Hugging Face directory or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV cache dtype")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, as a worker runs)")
    p.add_argument("--out", help="the profile JSON to write (default: ./NAME.json)")
    p.add_argument("--name", help="the profile's name (default: the --out file's stem, else MODEL-cpu)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time steps by the wall clock, or by the process's CPU time (with --threads 1 only: on a "
                        "busy machine, what a step costs on an idle core)")
    p.add_argument("--quick", action="store_true", help="a few steps only (seconds): a smoke run, a rough fit")
    p.add_argument("--from-steps", metavar="FILE",
                   help="fit on the steps a worker ran and logged (`kvfleet worker --step-log FILE`, wall clock) "
                        "instead of running the engine here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def from_steps(path: str, name: str | None) -> tuple[CostProfile, Fit, list[Sample]]:
    """A profile fitted on a worker's step log (gpu_worker.serve.step_log), with that worker's engine limits."""
    from gpu_worker.serve.step_log import read_step_log

    try:
        engine, steps = read_step_log(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--from-steps: {e}") from None
    samples = [Sample(shape, seconds) for shape, seconds in steps if seconds > 0]
    try:
        fit = fit_nonnegative(samples)
    except ValueError as e:
        raise SystemExit(f"--from-steps {path}: {e}") from None
    a, b, c, d, e = fit.coefficients
    model = Path(str(engine.get("model", "model"))).stem
    profile = CostProfile(
        name=name or f"{model}-steps", a_s=a, b_s_per_prefill_token=b, c_s_per_decode_seq=c, d_s_per_context_token=d,
        e_s_per_prefill_pair=e, num_kv_blocks=engine["num_kv_blocks"], block_size=engine["block_size"],
        max_num_seqs=engine["max_num_seqs"], max_num_batched_tokens=engine["max_num_batched_tokens"],
        source=(f"fitted on {len(samples)} steps a {engine.get('model')} worker ran under load ({path}, wall clock) "
                f"on {describe()}, {datetime.date.today().isoformat()} (`kvfleet bench calibrate "
                "--from-steps`)"),
        fit={"r2": round(fit.r2, 4), "mean_rel_error": round(fit.mean_rel_error, 4), "steps": len(samples),
             **{f"mean_rel_error_{k}": round(v, 4) for k, v in fit.rel_error_by_kind.items()}})
    return profile, fit, samples


def run(args: Any) -> int:
    if args.from_steps:
        profile, fit, samples = from_steps(args.from_steps, args.name)
        return _write(profile, fit, samples, args)
    import torch

    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1: the CPU time of several threads (and their spin-waits) "
                         "is not a step's duration")
    if args.threads:
        torch.set_num_threads(args.threads)
    profile, fit, samples = calibrate(args.model, dtype=args.dtype, name=args.name, quick=args.quick,
                                      cpu_clock=args.clock == "cpu", progress=not args.no_progress)
    return _write(profile, fit, samples, args)


def _write(profile: CostProfile, fit: Fit, samples: list[Sample], args: Any) -> int:
    out = Path(args.out or f"{profile.name}.json")
    if args.name is None and args.out:
        profile = replace(profile, name=out.stem)
    profile.save(out)
    print(report(profile, fit, samples))
    print(f"wrote {out}: `kvfleet worker --simulate {out}` (or `kvfleet up --simulate {out}`)")
    return 0
