"""Run a real fleet (a private Redis with AOF, 3 workers, 2 gateway replicas, a Celery worker) under a steady
mixed load (completion and chat, streaming and not, greedy and seeded sampling, n>1, HTTP clients that cancel
or disconnect, the Python client whole or cancelled, Celery tasks, small batch files through `kvfleet batch`)
while injecting faults at random with a fixed seed: SIGKILL, SIGTERM and SIGSTOP/SIGCONT of workers, SIGKILL
of a gateway, a Redis restart on the same AOF, dropped Redis connections (CLIENT KILL), poison requests.
Then check, and print as tables (the checks, the faults, the requests by door): every accepted request
answered exactly once, outputs equal to a fault-free reference, no chunk twice or skipped, no 5xx but 503
while Redis was down, no process gone or crashed, no work left in the workers, Redis memory back to its
baseline. Exit status 0 when every check passes, 1 otherwise."""

from __future__ import annotations

import argparse
import re
import signal
import sys
import tempfile
from pathlib import Path

from services.chaos.faults import KINDS


def duration(text: str) -> float:
    """'90', '90s', '10m', '1h' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--duration {text!r}: give seconds or a number with s, m or h (10m)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=duration, default=600.0, help="how long the faulted load runs (90s, 10m, 1h); "
                   "longer until every fault kind was injected once")
    p.add_argument("--seed", type=int, default=0, help="seeds the faults, their targets and the load: a run repeats")
    p.add_argument("--model", required=True, help="HF directory, .gguf file or alias the workers serve")
    p.add_argument("--clients", type=int, default=6, help="concurrent client threads keeping the load")
    p.add_argument("--faults", default=None, help=f"comma-separated fault kinds (default all): {', '.join(KINDS)}")
    p.add_argument("--work-dir", help="where the logs and the Redis AOF go (default a new temp dir, kept)")
    p.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from services.chaos.soak import SoakConfig, run_soak

    kinds = tuple(k.strip() for k in args.faults.split(",")) if args.faults else KINDS
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"--faults: unknown kind(s) {', '.join(unknown)}; the kinds are {', '.join(KINDS)}", file=sys.stderr)
        return 2
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="kvfleet-chaos-"))
    cfg = SoakConfig(model=args.model, duration_s=args.duration, seed=args.seed, work_dir=work_dir,
                     clients=args.clients, kinds=kinds, progress_every_s=args.progress_every)
    signal.signal(signal.SIGTERM, _interrupt)  # stopped like Ctrl-C: the fleet is stopped, nothing left running
    report = run_soak(cfg, say=lambda line: print(line, flush=True))
    print(report.table(), flush=True)
    if not report.passed:
        print(f"FAILED: {', '.join(report.failed())}; logs in {work_dir}", file=sys.stderr)
    return 0 if report.passed else 1
