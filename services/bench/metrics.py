"""What `kvfleet bench throughput` measures besides time: the model's FLOPs, KV waste, peak memory (no torch).

FLOPs count the work a forward must do (2 per multiply-add): every linear layer for every computed token,
attention over each token's context, lm_head only for the tokens that sample. Tokens served from the prefix
cache are not computed; tokens recomputed after a preemption are not counted (useful work only).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        return cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_layers=config.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab_size=config.vocab_size)

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of one decoder layer's matmuls (fused qkv and gate|up)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [("qkv", h, q + 2 * kv), ("o", q, h), ("gate_up", h, 2 * i), ("down", i, h)]

    @property
    def layer_linear_flops(self) -> int:
        """Per token, all decoder layers."""
        return 2 * self.num_layers * sum(k * n for _, k, n in self.linear_shapes())

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    def attention_flops(self, first_pos: int, num_tokens: int) -> int:
        """Tokens at positions first_pos .. first_pos + num_tokens - 1, each attending to itself and all
        before it: QK^T and PV, 2 * 2 * Hq * D per key, in every layer."""
        keys = num_tokens * first_pos + num_tokens * (num_tokens + 1) // 2
        return 4 * self.num_heads * self.head_dim * self.num_layers * keys

    def request_flops(self, prompt_len: int, output_len: int, cached_tokens: int = 0) -> int:
        """One request: prompt tokens past the prefix-cache hit and all output tokens but the last are
        computed; each output token is sampled from one lm_head row."""
        computed = prompt_len - cached_tokens + output_len - 1
        return (computed * self.layer_linear_flops + self.attention_flops(cached_tokens, computed)
                + output_len * self.lm_head_flops)


@dataclass
class KVWasteMeter:
    """KV waste sampled after every engine step: allocated token slots minus stored tokens, summed over the
    samples and divided by allocated slots summed over the samples (a slot-time average)."""

    samples: int = 0
    allocated_slot_steps: int = 0
    wasted_slot_steps: int = 0
    peak_used_blocks: int = 0
    peak_waste: float = 0.0

    def observe(self, used_blocks: int, allocated_slots: int, stored_tokens: int) -> None:
        if allocated_slots <= 0:
            return
        wasted = allocated_slots - stored_tokens
        assert 0 <= wasted <= allocated_slots, (allocated_slots, stored_tokens)
        self.samples += 1
        self.allocated_slot_steps += allocated_slots
        self.wasted_slot_steps += wasted
        self.peak_used_blocks = max(self.peak_used_blocks, used_blocks)
        self.peak_waste = max(self.peak_waste, wasted / allocated_slots)

    @property
    def waste(self) -> float:
        return self.wasted_slot_steps / self.allocated_slot_steps if self.allocated_slot_steps else 0.0


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, from /proc (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def process_tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc (<pid>/task/<tid>/children lists each thread's direct children)."""
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            pids += kids
            frontier += kids
    return pids


def cpu_seconds(pid: int | str = "self", children: bool = False) -> float:
    """User + system CPU seconds a process (and, with children, its living descendants) has used so far."""
    pids = process_tree(int(pid)) if children and pid != "self" else [pid]
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


class PeakRssSampler:
    """Peak RSS of this process (or of `pid` and its children) sampled every `interval_s` in a thread."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.1, children: bool = False):
        self.pid, self.interval_s, self.children = pid or os.getpid(), interval_s, children
        self.peak = rss_bytes(self.pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def __enter__(self) -> PeakRssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _pids(self) -> list[int]:
        return process_tree(self.pid) if self.children else [self.pid]

    def sample(self) -> None:
        self.peak = max(self.peak, sum(rss_bytes(p) for p in self._pids()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
