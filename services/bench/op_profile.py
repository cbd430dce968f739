"""Where an engine's time goes, per step kind and per operation (`kvfleet bench throughput --profile-ops`).

`OpProfile.attach(engine)` wraps, on that engine only, the runner's `execute` (one step's forward, wall time) and
`_forward` (one forward over a group of sequences: with 2 concurrent forwards a prefill step holds 2 of them),
the model's hot operations (`Ops`: attention, RMSNorm, rotary, SiLU-and-mul, KV store), the linear layers
(`cpu_linear.linear`: every projection and the lm_head) and the sampling (`isolation.sample`); a decode step
through the native decode stack (ops/cpu/decode_stack.py) reports the same op kinds, timed inside its one call.
`report()` gives, per step kind (a step with a chunk of 2+ tokens is a prefill step, else a decode step):
- wall seconds of the whole step, of its forward, of sampling, and the rest (scheduling, block copies, input
  tensors, detokenizing, output building: what runs in Python between forwards);
- thread-seconds per operation, and their share of the forwards' thread-seconds ("other": embedding, residual
  glue, Python between ops).
Timers are perf_counter pairs around each call: ~1 us each, a few thousand per step at most.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

OPS = ("paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache")


class OpProfile:
    def __init__(self) -> None:
        self.kind = "decode"  # the kind of the step that runs now
        self.wall: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # kind -> part -> s
        self.ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # kind -> op -> thread-s
        self.steps: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    # ---- wiring --------------------------------------------------------------------------------------
    def attach(self, engine: Any) -> OpProfile:
        from gpu_worker.engine import isolation
        from gpu_worker.executor.ops.cpu import linear as cpu_linear

        runner = engine.runner
        runner = getattr(runner, "runner", runner)  # a tensor-parallel runner: rank 0's own
        self._patch(runner, "execute", self._timed_execute)
        self._patch(runner, "_forward", lambda fn: self._timed(fn, "forward", self.ops))
        for name in OPS:
            self._patch(runner.model.ops, name, lambda fn, n=name: self._timed(fn, n, self.ops))
        self._patch(cpu_linear, "linear", lambda fn: self._timed(fn, "linear", self.ops))
        if (stack := getattr(runner.model, "decode_stack", None)) is not None:  # its ops timed inside the call
            stack.on_profile = self._add_stack_ops
            self._undo.append(lambda: setattr(stack, "on_profile", None))
        self._patch(isolation, "sample", lambda fn: self._timed(fn, "sampling", self.wall))
        self._patch(engine, "step", self._timed_step)
        return self

    def detach(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _patch(self, owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        had_own = name in getattr(owner, "__dict__", {})
        setattr(owner, name, wrap(original))
        self._undo.append(lambda: setattr(owner, name, original) if had_own else delattr(owner, name))

    def _timed(self, fn: Callable, name: str, table: dict) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                with self._lock:
                    table[self.kind][name] += dt
        return timed

    def _add_stack_ops(self, seconds: dict[str, float]) -> None:
        """One call of the native decode stack: its op kinds' seconds, timed in the C++."""
        with self._lock:
            for name, s in seconds.items():
                self.ops[self.kind][name] += s

    def _timed_execute(self, fn: Callable) -> Callable:
        def execute(sched: Any) -> Any:
            self.kind = "prefill" if any(len(s.token_ids) > 1 for s in sched.seqs) else "decode"
            t = time.perf_counter()
            try:
                return fn(sched)
            finally:
                self.wall[self.kind]["forward"] += time.perf_counter() - t
        return execute

    def _timed_step(self, fn: Callable) -> Callable:
        def step(*args: Any, **kwargs: Any) -> Any:
            self.kind = "idle"  # until the step's execute says what it is
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[self.kind]["step"] += time.perf_counter() - t
                self.steps[self.kind] += 1
        return step

    # ---- the report ----------------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        out = {}
        for kind in ("prefill", "decode"):
            if not self.steps.get(kind):
                continue
            wall, ops = dict(self.wall[kind]), dict(self.ops[kind])
            forward_threads = ops.pop("forward", 0.0)
            other = forward_threads - sum(ops.values())
            out[kind] = {
                "steps": self.steps[kind], "step_s": wall.get("step", 0.0), "forward_s": wall.get("forward", 0.0),
                "sampling_s": wall.get("sampling", 0.0),
                "between_forwards_s": wall.get("step", 0.0) - wall.get("forward", 0.0) - wall.get("sampling", 0.0),
                "forward_thread_s": forward_threads,
                "ops_thread_s": dict(sorted(ops.items(), key=lambda kv: -kv[1])) | {"other": other},
            }
        return out


def format_profile(report: dict[str, dict[str, Any]]) -> str:
    lines = ["kvfleet time per step kind (wall s) and per op (thread-s, share of the forwards' thread-s):"]
    for kind, r in report.items():
        per = r["step_s"] / r["steps"] * 1e3
        lines.append(f"  {kind}: {r['steps']} steps, {r['step_s']:.2f} s ({per:.1f} ms/step): forward "
                     f"{r['forward_s']:.2f}, sampling {r['sampling_s']:.2f}, between forwards (scheduler, inputs, "
                     f"outputs) {r['between_forwards_s']:.2f}")
        total = r["forward_thread_s"] or 1.0
        lines.append("    " + ", ".join(f"{op} {s:.2f} ({s / total:.0%})" for op, s in r["ops_thread_s"].items()))
    return "\n".join(lines)
