"""The `kvfleet` console script: one subcommand per module.

Each command module defines `add_arguments(parser)` and `run(args) -> int | None`, and imports nothing
heavy (torch, transformers) at module level, so `kvfleet --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("services.generate_cmd", "generate text offline with the engine (no fleet)"),
    "bench": ("services.bench.command", "benchmarks: `kvfleet bench throughput` against the baselines"),
    "worker": ("gpu_worker.serve.worker_cmd", "run one engine worker that serves its Redis stream"),
    "gateway": ("gateway.server", "run the OpenAI-compatible HTTP gateway"),
    "up": ("services.launcher", "start a whole fleet on this machine: Redis, gateway, N workers"),
    "status": ("services.status_cmd", "show the fleet at a glance"),
    "top": ("services.top", "live terminal view of the fleet"),
    "batch": ("services.batch", "run an OpenAI Batch API JSONL file through the fleet"),
    "cache": ("services.cache_cmd", "list or prune what kvfleet derived from models (~/.cache/kvfleet)"),
    "chaos": ("services.chaos.command", "soak a real fleet under load and random faults; check nothing is lost"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet",
        description="Serve language models from a Redis-stream-fed fleet of paged-KV-cache engines.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def import_name_clash() -> str | None:
    """Why this environment cannot run kvfleet's models, or None. Hugging Face's hub `kernels` package has the
    import name of this repo's kernels/ (the Triton kernels): transformers, finding it installed, imports ours in
    its place and fails (`cannot import name 'CUDAProperties' from 'kernels'`) when a worker loads a model."""
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return (f"kvfleet: the package `kernels` {dist.version} (Hugging Face's hub kernels) is installed in this "
            "environment; its import name is kvfleet's own kernels/, so transformers would load ours in its "
            "place and fail. Remove it (`pip uninstall kernels`); kvfleet does not use it, and transformers below "
            "5.25 (pyproject.toml) does not need it.")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (clash := import_name_clash()) is not None:
        print(clash, file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
