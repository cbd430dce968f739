"""The `kvfleet` console script: one subcommand per module.

Each command module defines `add_arguments(parser)` and `run(args) -> int | None`, and imports nothing
heavy (torch, transformers) at module level, so `kvfleet --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
