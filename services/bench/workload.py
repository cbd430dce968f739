"""Benchmark workloads: the fixed request sets `kvfleet bench throughput` runs (no torch).

Two formats, found next to the repository in ../shared/ (the team's reference copies) or, where the
repository was cloned elsewhere, in the copies bundled with this package (services/bench/workloads/):
- a peer file (peers/peer64.json): one JSON object whose "requests" hold prompt token ids and output
  lengths; its "model" field is replaced by the benchmark with a local model directory;
- a workload (workloads/*.jsonl): one request a line with prompt_len, output_len, prefix_group and
  prefix_len; prompt ids are drawn with a seeded RNG over the model's vocabulary (requests of one prefix
  group share their first prefix_len ids), as workloads/README.md says.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

SHARED_DIR = Path(__file__).resolve().parents[3] / "shared"  # ../shared next to the repository
DEFAULT_WORKLOAD = "peer64"
BUNDLED_DIR = Path(__file__).resolve().parent / "workloads"  # copies of peer64.json and workloads/*.jsonl
SEARCH_DIRS = (SHARED_DIR / "peers", SHARED_DIR / "workloads", BUNDLED_DIR)


@dataclass
class BenchRequest:
    id: int
    prompt_token_ids: list[int]
    output_len: int  # exactly this many tokens are generated (greedy, EOS ignored)


@dataclass
class Workload:
    name: str  # e.g. "peer64.json" or "sharegpt_like.jsonl (first 64)"
    path: Path
    requests: list[BenchRequest]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def with_lengths(self, output_len: int | None = None, prompt_len: int | None = None) -> Workload:
        """Every request generating exactly output_len tokens, and/or its prompt cut to its first prompt_len
        tokens (None: as it is). Both at least 1: ValueError naming the flag."""
        for flag, value in (("--output-len", output_len), ("--prompt-len", prompt_len)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        name, requests = self.name, self.requests
        if prompt_len is not None:
            name += f", prompts cut to {prompt_len} tokens"
            requests = [dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids[:prompt_len]) for r in requests]
        if output_len is not None:
            name += f", {output_len} output tokens each"
            requests = [dataclasses.replace(r, output_len=output_len) for r in requests]
        return dataclasses.replace(self, name=name, requests=requests)

    def to_peer_json(self, model_dir: str | Path) -> dict:
        """The peer-file form the baseline subprocesses read, with "model" set to a local directory."""
        return {"model": str(model_dir), "name": self.name,
                "requests": [{"id": r.id, "prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                             for r in self.requests]}


def resolve_workload_path(name: str | Path) -> Path:
    """An existing path, or a bare name ("peer64", "sharegpt_like", "alpaca_like.jsonl") looked up in
    ../shared/peers, ../shared/workloads, then the bundled copies."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    candidates = [d / f"{path.name}{ext}" for d in SEARCH_DIRS for ext in ("", ".json", ".jsonl")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"workload {str(name)!r} not found: give a path to a peer .json or a workload .jsonl, or a name from "
        f"{', '.join(str(d) for d in SEARCH_DIRS)}")


def prompt_ids_for(line: dict, *, vocab_size: int, seed: int) -> list[int]:
    """A workload line's prompt: prefix_len ids shared by its prefix group, then ids of its own. Each
    request has its own seeded RNG, so the first N requests are the same whatever N is."""
    prompt_len, prefix_len, group = int(line["prompt_len"]), int(line.get("prefix_len") or 0), line.get("prefix_group")
    ids: list[int] = []
    if group is not None and prefix_len > 0:
        prefix_rng = random.Random(f"kvfleet-bench:{seed}:prefix:{group}")
        ids = [prefix_rng.randrange(vocab_size) for _ in range(min(prefix_len, prompt_len))]
    own_rng = random.Random(f"kvfleet-bench:{seed}:request:{line['id']}")
    ids += [own_rng.randrange(vocab_size) for _ in range(prompt_len - len(ids))]
    return ids


def load_workload(name: str | Path, *, vocab_size: int, num_requests: int | None = None,
                  seed: int = 0) -> Workload:
    """Read a peer .json or a workload .jsonl; keep the first num_requests requests (all when None)."""
    path = resolve_workload_path(name)
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    if path.suffix == ".jsonl":
        lines = []
        with path.open() as f:
            for text in f:
                if text.strip():
                    lines.append(json.loads(text))
                if num_requests is not None and len(lines) >= num_requests:
                    break
        requests = [BenchRequest(int(line["id"]), prompt_ids_for(line, vocab_size=vocab_size, seed=seed),
                                 int(line["output_len"])) for line in lines]
    else:
        data = json.loads(path.read_text())
        default_out = data.get("output_len")
        requests = [BenchRequest(int(r["id"]), [int(t) for t in r["prompt_token_ids"]],
                                 int(r.get("output_len", default_out)))
                    for r in data["requests"][:num_requests]]
        too_big = [r.id for r in requests if any(not 0 <= t < vocab_size for t in r.prompt_token_ids)]
        if too_big:
            raise ValueError(f"{path.name}: requests {too_big[:5]} hold token ids outside the model's "
                             f"vocabulary of {vocab_size}; this peer file was made for another tokenizer")
    if not requests:
        raise ValueError(f"{path} holds no requests")
    name_text = path.name if num_requests is None else f"{path.name} (first {len(requests)})"
    return Workload(name=name_text, path=path, requests=requests)
