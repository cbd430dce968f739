"""The cost model of a simulated worker: how long one engine step takes for one model on one device, and
which token ids it "generates".

One step costs `a + b * prefill_tokens + c * decode_seqs + d * context_tokens + e * prefill_pairs` seconds,
where prefill_tokens are the prompt (or recomputed) tokens the step runs, decode_seqs the sequences that run
one new token, context_tokens the keys/values attention reads (the sum of every scheduled sequence's context
length), and prefill_pairs the (query, key) pairs a prefill's attention computes (n tokens after s already in
the cache: n * s + n * (n + 1) / 2). The fixed part `a` is the per-step overhead (scheduling, launch,
sampling), `b` the weight-bound cost of a prefill token, `c` that of a decode row, `d` the memory-bound cost of
attention, `e` its compute in a prefill: quadratic in the prompt, which a CPU feels (on a GPU, flash attention
hides it at these lengths, and the derived GPU profiles leave e at 0).

A profile is a JSON file: fitted on the real engine here (`kvfleet bench calibrate`) or derived from
published figures (its `source` says which). Names without a path are looked up in profiles/ beside this
module.

Token ids are a pure function of (seed, request id, position): the same request on any simulated worker,
after any takeover, produces the same text. They avoid the ids given (EOS, special tokens), so a simulated
request runs to max_tokens unless a stop id is drawn by design.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_worker.core.sched_output import SchedulerOutput

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class StepShape:
    """What a step costs depends on only these numbers."""

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    prefill_pairs: int = 0

    @classmethod
    def of(cls, sched: SchedulerOutput) -> StepShape:
        prefill = decode = context = pairs = 0
        for s in sched.seqs:
            n = len(s.token_ids)
            if n == 1 and s.start_pos > 0:
                decode += 1
            else:
                prefill += n
                pairs += n * s.start_pos + n * (n + 1) // 2
            context += s.context_len
        return cls(prefill, decode, context, pairs)


class StepShapes:
    """Notes the shape of each step a model runner executes (it wraps `runner.execute`): `take()` returns the
    last one noted, once (None when no forward ran since). `close()` unwraps the runner. For timing steps by
    their shape: `kvfleet bench calibrate` and a worker's --step-log."""

    def __init__(self, runner: Any):
        self.runner, self._forward = runner, runner.execute
        self._last: StepShape | None = None

        def execute(sched: SchedulerOutput) -> Any:
            self._last = StepShape.of(sched)
            return self._forward(sched)

        runner.execute = execute

    def take(self) -> StepShape | None:
        shape, self._last = self._last, None
        return shape

    def close(self) -> None:
        self.runner.execute = self._forward


@dataclass(frozen=True)
class CostProfile:
    name: str
    a_s: float  # seconds per step
    b_s_per_prefill_token: float
    c_s_per_decode_seq: float
    d_s_per_context_token: float
    e_s_per_prefill_pair: float = 0.0
    num_kv_blocks: int = 4096  # the KV cache a worker of this kind holds
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    source: str = ""  # "calibrated: <model> on <cpu>, <date>" or "derived from published figures: <where>"
    fit: dict[str, float] = field(default_factory=dict)  # goodness of fit of a calibration (r2, mean error)

    def step_seconds(self, shape: StepShape) -> float:
        return (self.a_s + self.b_s_per_prefill_token * shape.prefill_tokens
                + self.c_s_per_decode_seq * shape.decode_seqs + self.d_s_per_context_token * shape.context_tokens
                + self.e_s_per_prefill_pair * shape.prefill_pairs)

    @classmethod
    def load(cls, name_or_path: str | Path) -> CostProfile:
        """A profile by file path, or by name from profiles/ ("smollm2-cpu" or "smollm2-cpu.json")."""
        path = Path(name_or_path)
        if not path.is_file() and len(path.parts) == 1:  # a name: "llama3.1-8b-h100-bf16" has a dot too
            path = PROFILE_DIR / (path.name if path.name.endswith(".json") else f"{path.name}.json")
        if not path.is_file():
            known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise ValueError(f"no cost profile {str(name_or_path)!r}: give a .json path or one of {known} "
                             "(`kvfleet bench calibrate` writes one)")
        data = json.loads(path.read_text())
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"cost profile {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def sim_token(seed: int, request_id: str, position: int, vocab_size: int, avoid: frozenset[int] = frozenset()) -> int:
    """The token a simulated model emits at `position` of request `request_id`: uniform over the vocabulary
    less `avoid`, and the same every time for the same arguments."""
    digest = hashlib.blake2b(f"{seed}:{request_id}:{position}".encode(), digest_size=8).digest()
    token = int.from_bytes(digest, "little") % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token
