"""`kvfleet bench fleet-sim`: simulate a fleet of N workers (the real scheduler and KV cache with a cost
model's step times) behind the real router, on a virtual clock, and compare routing policies on the same
generated workload.

    # shared prefixes: 64 tenants' system prompts of 4-8k tokens, and multi-turn chats on them
    kvfleet bench fleet-sim --workers 16 --rate 60 --num-requests 1500 --system-prompts 64 \\
        --system-prompt-tokens 4096-8192 --profile llama3.1-8b-a100-bf16 --json sp16.json  # + sp16.html
    # KV memory pressure
    kvfleet bench fleet-sim --workers 16 --workload long-context --rate 200 --num-requests 2000 \\
        --policies least_loaded,free_blocks --json mem16.json

Each policy runs the same requests (same seed) on a fresh fleet. See services/bench/fleet_sim.py for what is
and is not modelled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.router import POLICIES

DEFAULT_PROFILE = "llama3.1-8b-h100-bf16"  # a fleet of 8-128 workers is a GPU fleet


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    from services.bench.fleet_sim_workloads import SYSTEM_PROMPTS, SYSTEM_TOKENS, WORKLOADS

    p = sub.add_parser("fleet-sim", help="simulate routing policies on N workers (discrete-event, virtual clock)",
                       description=__doc__, formatter_class=_Formatter)
    p.add_argument("--workers", type=int, default=16, help="simulated workers (8-128 is the intended range)")
    p.add_argument("--workload", default="shared-prefix",
                   help=f"a generated workload ({', '.join(WORKLOADS)}), or a fixed one of `kvfleet bench serve` "
                        "(a name in ../shared/workloads or peer64, or a path) with the arrivals bench serve gives it "
                        "at the same --rate and --seed: to check the simulator against a real run")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--num-requests", type=int, default=None, help="requests to send (default 2000)")
    p.add_argument("--duration", type=float, default=None, help="or: send for this many (virtual) seconds")
    p.add_argument("--system-prompts", type=int, default=SYSTEM_PROMPTS,
                   help="shared-prefix: how many system prompts the users share")
    p.add_argument("--system-prompt-tokens", default=f"{SYSTEM_TOKENS[0]}-{SYSTEM_TOKENS[1]}",
                   help="shared-prefix: their lengths, LO-HI tokens (uniform)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="cost profile: a name in gpu_worker/executor/profiles/ or a .json path")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated routing policies to compare")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (arrivals, prompts, lengths)")
    p.add_argument("--max-model-len", type=int, default=16384, help="each worker's context window")
    p.add_argument("--prefix-weight", type=float, default=None,
                   help="the prefix policy's weight of an uncached prompt block against a block in use "
                        "(Settings.prefix_weight; default: its default)")
    p.add_argument("--prefix-affinity-slack", type=int, default=None,
                   help="prefix policy: only workers with at most this many requests more than the least loaded "
                        "compete; negative: no bound (Settings.prefix_affinity_slack; default: its default)")
    p.add_argument("--json", type=Path, default=None, help="write the results here (and charts beside it, .html)")
    p.add_argument("--html", type=Path, default=None, help="write the charts here (default: beside --json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from gpu_worker.executor.cost_model import CostProfile
    from services.bench.fleet_sim import FleetSim, default_settings
    from services.bench.fleet_sim_report import format_table, summarize, write_plots
    from services.bench.fleet_sim_workloads import WORKLOADS, from_bench_workload, generate

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if bad := [p for p in policies if p not in POLICIES]:
        raise ValueError(f"--policies: {bad} unknown; choose from {','.join(POLICIES)}")
    profile = CostProfile.load(args.profile)
    num = args.num_requests if args.num_requests is not None or args.duration is not None else 2000
    try:
        lo, hi = (int(v) for v in args.system_prompt_tokens.split("-"))
    except ValueError:
        raise ValueError(f"--system-prompt-tokens must be LO-HI (e.g. 1024-2048), got {args.system_prompt_tokens!r}") from None
    if args.workload in WORKLOADS:
        requests = generate(args.workload, rate=args.rate, seed=args.seed, num_requests=num,
                            duration_s=args.duration, system_prompts=args.system_prompts, system_tokens=(lo, hi))
    else:
        requests = from_bench_workload(args.workload, rate=args.rate, seed=args.seed, num_requests=args.num_requests)
    if not requests:
        raise ValueError(f"no request arrives within --duration {args.duration}s at --rate {args.rate}; raise either")
    settings = default_settings().with_overrides(prefix_weight=args.prefix_weight,
                                                 prefix_affinity_slack=args.prefix_affinity_slack)
    header = (f"fleet-sim: {args.workers} workers, profile {profile.name}, workload {args.workload}, "
              f"{len(requests)} requests at {args.rate:g}/s, seed {args.seed}, prefix weight "
              f"{settings.prefix_weight:g}, affinity slack {settings.prefix_affinity_slack}")
    print(header, file=sys.stderr, flush=True)
    runs, summaries = [], []
    for policy in policies:
        sim = FleetSim(policy, profile, args.workers, max_model_len=args.max_model_len, settings=settings)
        bar = _Progress(policy, requests[-1].arrival_s, disabled=args.no_progress)
        try:
            result = sim.run(requests, progress=bar.advance)
        finally:
            bar.close()
        runs.append(result)
        summaries.append(summarize(result))
    print(format_table(summaries, header))
    html = args.html or (args.json.with_suffix(".html") if args.json else None)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"workers": args.workers, "profile": profile.name, "workload": args.workload,
                                         "rate": args.rate, "seed": args.seed, "requests": len(requests),
                                         "prefix_weight": settings.prefix_weight,
                                         "prefix_affinity_slack": settings.prefix_affinity_slack,
                                         "system_prompts": args.system_prompts,
                                         "system_prompt_tokens": [lo, hi],
                                         "policies": summaries}, indent=2) + "\n")
    if html:
        write_plots(html, header, runs, notes=[f"profile source: {profile.source or 'not given'}"])
    return 0


class _Progress:
    """tqdm on stderr over virtual seconds (up to the last arrival, then the total grows with the drain)."""

    def __init__(self, policy: str, total_s: float, *, disabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=round(total_s, 1), desc=policy, unit="sim s", file=sys.stderr, disable=disabled,
                        dynamic_ncols=True, bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} sim s [{elapsed}]")
        self.shown = 0.0

    def advance(self, now: float) -> None:
        if now > self.shown:
            if now > (self.bar.total or 0):  # past the last arrival: tqdm drops a total that n overran
                self.bar.total = round(now, 1) + 0.1
            self.bar.update(round(now - self.shown, 3))
            self.shown = now

    def close(self) -> None:
        self.bar.close()
