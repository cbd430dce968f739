"""The sampling parameters a benchmark gives every system alike (`--temperature`, `--top-p`, `--top-k`), checked
by kvfleet's own rules, in the form the peers and the requests take them."""

from __future__ import annotations

import argparse

from shared.sampling_params import SamplingParams


def sampling_args(args: argparse.Namespace) -> dict:
    """--temperature / --top-p / --top-k as the peers read them (their JSON's "sampling"); raises ValueError,
    naming the flag, for a value kvfleet refuses."""
    sampling = {"temperature": getattr(args, "temperature", 0.0), "top_p": getattr(args, "top_p", 1.0),
                "top_k": getattr(args, "top_k", 0)}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        name, rule = str(e).split(" ", 1)
        raise ValueError(f"--{name.replace('_', '-')} {rule}") from None
    return sampling


def describe_sampling(sampling: dict | None) -> str:
    if not sampling or sampling["temperature"] == 0:
        return "greedy"
    off = {"top_p": 1.0, "top_k": 0}
    return "sampled: " + ", ".join(f"{k} {v}" for k, v in sampling.items() if off.get(k) != v)
