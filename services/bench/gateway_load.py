"""`kvfleet bench gateway`: how many requests/s one gateway process carries when it is the limit, and N replicas.

A fleet is started for the run (`kvfleet up`: a private Redis, --gateways gateways and --workers simulated workers,
by default with the zero-cost profile, so no model runs and what is measured is the gateway and Redis) and stopped
after it. The gateways get the last CPU to themselves; Redis, the workers and the load generator share the others. With
--cpu-share each gateway is also held to that fraction of a core by a cgroup CPU quota of its own, so that it,
not the rest of the fleet, is the limit on a small machine (2 cores: the rest caps the fleet at a few hundred
requests/s).

The load is Debian's `wrk` (C: a Python load generator spends more CPU per request than the gateway), one per
gateway, --connections connections each, POSTing a streamed --max-tokens completion to /v1/completions for
--duration seconds, after a --warmup. Each round reports requests/s (and non-2xx answers), the gateways' CPU
from /proc over the round, the CPU per request, and what that is per core of CPU (1 s / CPU per request).

    kvfleet bench gateway [--gateways 2] [--cpu-share 0.3] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.bench.cpu import cpu_info, describe
from services.bench.serve_endpoints import ServerFailed, start_kvfleet, stop, wait_ready

CLK_TCK = os.sysconf("SC_CLK_TCK")
PERIOD_US = 100_000  # the quota's period
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")

WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model": "smollm2", "prompt": "Write a haiku about the sea and the wind.", "max_tokens": %d, "stream": true, "ignore_eos": true}'
"""


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("gateway", help="requests/s of one gateway process (and of N replicas) when it is the limit",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--gateways", type=int, default=1, help="gateway replicas, each with its own wrk (default 1)")
    a("--workers", type=int, default=2, help="simulated workers behind them (default 2)")
    a("--profile", default="zero", help="the simulated workers' cost profile, a name in gpu_worker/executor/profiles "
      "or a .json path (default zero: every step is free; one with a step time paces the tokens as an engine "
      "does, one chunk per token, for the gateway's cost per streamed token with --max-tokens)")
    a("--cpu-share", type=float, help="hold each gateway to this fraction of a core (a cgroup CPU quota; needs "
      "root or a writable cgroup); default: no quota, the gateways share the last CPU")
    a("--connections", type=int, default=64, help="wrk connections per gateway (default 64)")
    a("--duration", type=float, default=15.0, help="seconds of each measured round (default 15)")
    a("--warmup", type=float, default=3.0, help="seconds of load before the first round (default 3)")
    a("--rounds", type=int, default=1, help="measured rounds on the same fleet (default 1)")
    a("--max-tokens", type=int, default=1, help="output tokens per request (default 1: the gateway's per-request "
      "cost; more adds its per-token cost)")
    a("--timeout", type=float, default=30.0, help="seconds wrk waits for a response before it counts a timeout "
      "instead of a request (default 30; wrk's own 2 s would drop slow answers from a loaded machine)")
    a("--startup-timeout", type=float, default=300.0, help="seconds to wait for the fleet (default 300)")
    a("--json", action="store_true", help="print one JSON object instead of the table")


@dataclass
class Round:
    requests: int
    non_2xx: int
    wall_s: float
    gateway_cpu_s: float
    tokens_per_request: int = 1  # output tokens each request streams (max_tokens, EOS ignored)
    timeouts: int = 0  # requests wrk gave up on after --timeout (not counted in `requests`)
    socket_errors: int = 0  # connections that failed to connect, read or write

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.gateway_cpu_s / max(1, self.requests)

    def row(self) -> dict[str, float]:
        return asdict(self) | {"requests_per_s": round(self.requests_per_s, 1),
                               "gateway_cpu_share": round(self.gateway_cpu_s / self.wall_s, 3),
                               "cpu_ms_per_request": round(self.cpu_ms_per_request, 3),
                               "requests_per_s_per_core": round(1000 / max(self.cpu_ms_per_request, 1e-9), 0),
                               "cpu_us_per_token": round(1000 * self.cpu_ms_per_request / self.tokens_per_request, 1)}


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"kvfleet bench gateway: {problem}", flush=True)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    gateway_cpu, rest = cpus[-1], set(cpus[:-1])
    info = cpu_info()
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-gateway-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(WRK_SCRIPT % args.max_tokens)
        server = start_kvfleet("smollm2", args.workers, None, Path(tmp),
                               ["--simulate", args.profile, "--no-warmup"], cpus=rest,
                               gateways=args.gateways)
        try:
            wait_ready(server, args.startup_timeout, workers=args.workers)
            port = int(server.url.rsplit(":", 1)[1])
            urls = [f"http://127.0.0.1:{port + g}" for g in range(args.gateways)]
            gateways = _gateway_pids(server.proc.pid, args.gateways)
            for pid in gateways:
                _pin(pid, {gateway_cpu})
            with _quotas(gateways, args.cpu_share):
                _load(urls, script, args.connections, args.warmup, args.timeout, rest)
                rounds = [_round(urls, script, args.connections, args.duration, args.timeout, gateways, rest,
                                 args.max_tokens) for _ in range(args.rounds)]
        except ServerFailed as e:
            print(f"kvfleet bench gateway: {e}", flush=True)
            return 1
        finally:
            stop(server)
    report = {"cpu": {k: v for k, v in info.items() if k != "flags"}, "gateways": args.gateways,
              "workers": args.workers, "profile": args.profile, "cpu_share": args.cpu_share,
              "connections": args.connections, "duration_s": args.duration, "timeout_s": args.timeout,
              "max_tokens": args.max_tokens, "rounds": [r.row() for r in rounds]}
    print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
    return 0


def _check(args: argparse.Namespace) -> str | None:
    """What keeps this run from measuring anything, in words, or None."""
    if shutil.which("wrk") is None:
        return ("needs `wrk` (a load generator in C: apt-get install wrk); a Python one spends more CPU per "
                "request than the gateway it measures")
    if len(os.sched_getaffinity(0)) < 2:
        return "needs at least 2 CPUs: one for the gateways, the rest for Redis, the workers and wrk"
    for name in ("gateways", "workers", "connections", "rounds", "max_tokens"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.duration <= 0 or args.warmup < 0:
        return f"--duration must be > 0 and --warmup >= 0, got {args.duration:g} and {args.warmup:g}"
    if args.timeout < 1:
        return f"--timeout must be >= 1 (wrk's resolution: whole seconds), got {args.timeout:g}"
    if args.cpu_share is not None and not 0.01 <= args.cpu_share <= 1:
        return f"--cpu-share must be in [0.01, 1] (a fraction of one core), got {args.cpu_share:g}"
    if args.cpu_share is not None and args.gateways * args.cpu_share > 1:
        return (f"--gateways {args.gateways} x --cpu-share {args.cpu_share:g} is more than the one CPU the gateways "
                "share")
    return None


def _gateway_pids(launcher: int, count: int, timeout_s: float = 10.0) -> list[int]:
    """The gateway processes `kvfleet up` (pid `launcher`) started (its children running `services.cli gateway`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [pid for pid in _children(launcher) if "gateway" in _cmdline(pid)[3:4]]
        if len(found) >= count:
            return sorted(found)[:count]
        time.sleep(0.2)
    raise ServerFailed(f"kvfleet up (pid {launcher}) shows fewer than {count} gateway processes")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _threads(pid: int) -> list[int]:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in _threads(pid):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@contextlib.contextmanager
def _quotas(pids: list[int], share: float | None) -> Iterator[None]:
    """Each process in a cgroup of its own, held to `share` of a core (cgroup v1's cpu controller or v2's
    cpu.max); removed after. Nothing when share is None."""
    if share is None:
        yield
        return
    quota = int(share * PERIOD_US)
    v1 = CGROUP_V1.is_dir()
    made: list[Path] = []
    try:
        if not v1:
            with contextlib.suppress(OSError):  # the cpu controller for the groups below the root
                (CGROUP_V2 / "cgroup.subtree_control").write_text("+cpu")
        for i, pid in enumerate(pids):
            group = (CGROUP_V1 if v1 else CGROUP_V2) / f"kvfleet-bench-{os.getpid()}-{i}"
            group.mkdir()
            made.append(group)
            if v1:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
                for tid in _threads(pid):
                    with contextlib.suppress(ProcessLookupError):
                        (group / "tasks").write_text(str(tid))
            else:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                (group / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        _remove(made, pids)
        raise ServerFailed(f"--cpu-share needs a cgroup it can write (cgroup v1's cpu controller at {CGROUP_V1}, "
                           f"or v2's cpu.max under {CGROUP_V2}; usually root): {e}. Leave --cpu-share out to "
                           "measure without a quota") from None
    try:
        yield
    finally:
        _remove(made, pids)


def _remove(groups: list[Path], pids: list[int]) -> None:
    """Move group i's process (pids[i]) back to the root group, then remove the group."""
    for group, pid in zip(groups, pids, strict=False):
        root = group.parent / ("tasks" if group.parent == CGROUP_V1 else "cgroup.procs")
        for tid in _threads(pid) if Path(f"/proc/{pid}").exists() else []:
            with contextlib.suppress(OSError):
                root.write_text(str(tid))
        with contextlib.suppress(OSError):
            group.rmdir()


def _wrk(url: str, script: Path, connections: int, seconds: float, timeout: float,
         cpus: set[int]) -> subprocess.Popen:
    return subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                             f"--timeout={max(1, round(timeout))}s", "-s", str(script), f"{url}/v1/completions"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def _load(urls: list[str], script: Path, connections: int, seconds: float, timeout: float,
          cpus: set[int]) -> list[str]:
    """Every gateway under wrk at once for `seconds`; each wrk's report."""
    if seconds <= 0:
        return []
    procs = [_wrk(u, script, connections, seconds, timeout, cpus) for u in urls]
    return [p.communicate()[0] for p in procs]


def _round(urls: list[str], script: Path, connections: int, seconds: float, timeout: float, gateways: list[int],
           cpus: set[int], tokens_per_request: int) -> Round:
    cpu0, t0 = sum(_cpu_s(p) for p in gateways), time.monotonic()
    outputs = _load(urls, script, connections, seconds, timeout, cpus)
    cpu1, t1 = sum(_cpu_s(p) for p in gateways), time.monotonic()
    counts = [parse_wrk(out) for out in outputs]
    return Round(requests=sum(c.requests for c in counts), non_2xx=sum(c.non_2xx for c in counts),
                 wall_s=round(t1 - t0, 3), gateway_cpu_s=round(cpu1 - cpu0, 3), tokens_per_request=tokens_per_request,
                 timeouts=sum(c.timeouts for c in counts), socket_errors=sum(c.socket_errors for c in counts))


@dataclass(frozen=True)
class WrkCounts:
    requests: int  # completed, whatever their status
    non_2xx: int
    timeouts: int
    socket_errors: int  # connect, read and write errors


def parse_wrk(out: str) -> WrkCounts:
    """The counts of wrk's report (its "Socket errors" line appears only when there were any)."""
    done = re.search(r"(\d+) requests in", out)
    if done is None:
        raise ServerFailed(f"wrk gave no result:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    connect, read, write, timeouts = (int(g) for g in errors.groups()) if errors else (0, 0, 0, 0)
    return WrkCounts(int(done.group(1)), int(bad.group(1)) if bad else 0, timeouts, connect + read + write)


def format_report(report: dict[str, Any]) -> str:
    share = report["cpu_share"]
    held = f"each held to {share:g} of a core" if share is not None else "no quota"
    lines = [f"CPU: {describe(report['cpu'])}, {report['cpu']['cores']} cores, load average "
             f"{report['cpu']['load_average_1m']} at the start",
             f"{report['gateways']} gateway(s) on the last CPU ({held}); {report['workers']} simulated workers "
             f"(profile {report['profile']}), Redis and wrk ({report['connections']} connections per gateway) on "
             f"the others; streamed {report['max_tokens']}-token completions, {report['duration_s']:g} s per round", "",
             "| round | requests/s | non-2xx | timeouts / socket errors | gateway CPU (cores) | CPU per request | "
             "requests/s per core | CPU per token |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(report["rounds"], 1):
        lines.append(f"| {i} | {r['requests_per_s']:,.1f} | {r['non_2xx']} | {r['timeouts']} / {r['socket_errors']} | "
                     f"{r['gateway_cpu_share']:.2f} | "
                     f"{r['cpu_ms_per_request']:.3f} ms | {r['requests_per_s_per_core']:,.0f} | "
                     f"{r['cpu_us_per_token']:,.1f} us |")
    return "\n".join(lines)
