"""`kvfleet worker --step-log FILE`: one JSON line per engine step that ran a forward, with its shape (what a
simulated worker's cost model prices: gpu_worker.executor.cost_model.StepShape) and its wall-clock seconds,
after a first line with the worker's engine limits. `kvfleet bench calibrate --from-steps FILE` fits a cost
profile on them: the steps a worker ran under real load (its prefix-cache hits, its mixes of prefill chunks
and decodes, the other processes it shares the machine with), to check or refit a simulated worker's profile.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpu_worker.executor.cost_model import StepShape, StepShapes


class StepLog:
    def __init__(self, path: str, engine: Any):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the worker's lifetime; close())
        cfg, kv = engine.scheduler.config, engine.scheduler.kv_cache_manager
        self.file.write(json.dumps({"engine": {"model": engine.model_name, "block_size": kv.block_size,
                                               "num_kv_blocks": kv.num_blocks, "max_num_seqs": cfg.max_num_seqs,
                                               "max_num_batched_tokens": cfg.max_num_batched_tokens}}) + "\n")
        self.shapes = StepShapes(engine.runner)

    def step(self, seconds: float) -> None:
        """The step just taken lasted `seconds` (nothing is written for a step without a forward)."""
        shape = self.shapes.take()
        if shape is not None:
            self.file.write(json.dumps(dataclasses.asdict(shape) | {"seconds": round(seconds, 6)}) + "\n")

    def close(self) -> None:
        self.shapes.close()
        self.file.close()


def read_step_log(path: str) -> tuple[dict[str, Any], list[tuple[StepShape, float]]]:
    """(the engine's limits, [(shape, seconds)]) from a step log; ValueError naming the line when it is not one."""
    engine: dict[str, Any] = {}
    steps: list[tuple[StepShape, float]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                if "engine" in row:
                    engine = row["engine"]
                    continue
                seconds = float(row.pop("seconds"))
                steps.append((StepShape(**row), seconds))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a step-log line ({type(e).__name__}: {e})") from None
    if not engine:
        raise ValueError(f"{path}: no engine line: not a `kvfleet worker --step-log` file")
    return engine, steps
