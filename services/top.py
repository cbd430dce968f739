"""A live terminal view of the fleet (`kvfleet top`): each worker with its model, a free-KV-block bar, reserved
blocks, running and waiting requests, tokens/s, TTFT percentiles and restarts (by `kvfleet up`); the request
streams with their length, pending and lag. Refreshes every --interval seconds; q or Ctrl-C quits. `--once`
prints one plain-text frame (for scripts). `kvfleet status` prints the same frame from a single read.

Everything comes from Redis (the workers' statuses and the streams: shared.streams.afleet_snapshot); tokens/s
is the change of each worker's generated-token count between two reads.
"""

from __future__ import annotations

import argparse
import asyncio
import textwrap
import time
from dataclasses import dataclass
from typing import Any

from shared import streams
from shared.fleet_state import FleetSnapshot, lag
from shared.settings import Settings, redacted_url

BAR_WIDTH = 20
MODEL_WIDTH = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (env KVFLEET_REDIS_URL)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true",
                   help="print one frame as plain text and exit (two reads --interval apart, for tokens/s)")


@dataclass
class Sample:
    snap: FleetSnapshot
    at: float  # time.monotonic() of the read


class FleetReader:
    """Reads the fleet snapshot over one asyncio Redis client on a private event loop."""

    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.r = streams.connect_async(url, socket_timeout=5)

    def read(self) -> Sample:
        return Sample(self.loop.run_until_complete(streams.afleet_snapshot(self.r)), time.monotonic())

    def close(self) -> None:
        self.loop.run_until_complete(self.r.aclose())
        self.loop.close()


UP_URL_HINT = ("`kvfleet up` starts its own Redis, with a password, and prints the file that holds its URL "
               "(DATA_DIR/redis-url): pass it with --redis-url \"$(cat DATA_DIR/redis-url)\" or KVFLEET_REDIS_URL")


def unreadable(e: Exception) -> str:
    """Why the fleet could not be read, and what to do where the error says (a missing password, no Redis)."""
    why = f"{type(e).__name__}: {str(e).rstrip('.')}"
    if isinstance(e, streams.AuthenticationError):  # (before CONNECTION_ERRORS: redis-py's is one too)
        return f"{why}. The URL needs the Redis's password: {UP_URL_HINT}"
    if isinstance(e, streams.CONNECTION_ERRORS):
        return f"{why}. Is a Redis running there? {UP_URL_HINT}"
    return why


def redis_memory(memory: dict[str, Any] | None) -> str:
    """" | redis 3.3 of 64.0 MiB", and when it is past its cap under noeviction, that it refuses writes."""
    if not memory:
        return ""
    used, cap, mib = memory["used_memory"], memory["maxmemory"], 1024 * 1024
    if not cap:
        return f" | redis {used / mib:.1f} MiB"
    full = used >= cap and memory.get("maxmemory_policy") == "noeviction"
    return f" | redis {used / mib:.1f} of {cap / mib:.1f} MiB" + (
        ": FULL, it refuses writes (raise its maxmemory)" if full else "")


def bar(free: int, total: int, width: int = BAR_WIDTH) -> str:
    """`[######..............]`: '#' for used blocks, '.' for free ones."""
    used = 0 if total <= 0 else round(width * (total - free) / total)
    return "[" + "#" * used + "." * (width - used) + "]"


def tokens_per_s(now: Sample, prev: Sample | None, worker_id: str) -> float | None:
    if prev is None or now.at <= prev.at:
        return None
    before = {w["worker_id"]: w for w in prev.snap["workers"]}.get(worker_id)
    after = {w["worker_id"]: w for w in now.snap["workers"]}[worker_id]
    if before is None or "generation_tokens" not in after:
        return None
    return max(0, after["generation_tokens"] - before["generation_tokens"]) / (now.at - prev.at)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _model(name: str) -> str:
    return name if len(name) <= MODEL_WIDTH else "…" + name[-(MODEL_WIDTH - 1):]


def render(now: Sample, prev: Sample | None, width: int = 150) -> list[str]:
    """One frame as lines (no colors): the curses view, --once and `kvfleet status` print the same. Without
    `prev` (one read) tokens/s shows "-"."""
    snap = now.snap
    lines = [f"{'WORKER':<20} {'MODEL':<{MODEL_WIDTH}} {'FREE KV BLOCKS':<{BAR_WIDTH + 2}} {'FREE/TOTAL':>11} "
             f"{'RESV':>5} {'RUN':>4} {'WAIT':>4} {'TOK/S':>7} {'TTFT p50/p95/p99 ms':>20} {'PREEMPT':>7} "
             f"{'RESTARTS':>8} {'HB':>5}"]
    total_tps = 0.0
    for w in sorted(snap["workers"], key=lambda w: w["worker_id"]):
        tps = tokens_per_s(now, prev, w["worker_id"])
        total_tps += tps or 0.0
        ttft = "/".join(_ms(w.get(f"ttft_p{q}_s")) for q in (50, 95, 99))
        flag = (" draining" if w.get("draining") else "") + (f" simulated:{w['simulated']}" if w.get("simulated")
                                                              else "")
        lines.append(f"{w['worker_id'][:20]:<20} {_model(w['model']):<{MODEL_WIDTH}} "
                     f"{bar(w['free_blocks'], w['total_blocks'])} {w['free_blocks']:>5}/{w['total_blocks']:<5} "
                     f"{w['reserved_blocks']:>5} {w['running']:>4} {w['waiting']:>4} "
                     f"{'-' if tps is None else f'{tps:.1f}':>7} {ttft:>20} {w['num_preemptions']:>7} "
                     f"{w.get('restarts', 0):>8} "
                     f"{w['heartbeat_age_s']:>4.1f}s{flag}")
    if not snap["workers"]:
        lines.append("(no live worker)")
    if snap["dead_workers"]:
        lines.append(f"dead: {', '.join(snap['dead_workers'])} (their requests are being taken over)")
    for worker, why in (snap.get("unreadable_workers") or {}).items():
        lines.append(f"unreadable: {worker}'s status ({why}): left out of the fleet; a worker of another kvfleet "
                     "version?")
    lines.append("")
    lines.append(f"{'STREAM':<40} {'LENGTH':>8} {'PENDING':>8} {'LAG':>8}")
    for name, info in snap["streams"].items():
        lines.append(f"{name[:40]:<40} {info['length']:>8} {info['pending']:>8} {lag(info):>8}")
    lines.append("")
    lines.append(f"workers {len(snap['workers'])} live, {len(snap['dead_workers'])} dead | "
                 f"{total_tps:.1f} tokens/s | dead letters {snap['dead_letters']}{redis_memory(snap.get('redis'))}")
    if failed := (snap.get("redis") or {}).get("persistence_error"):  # a full disk, say
        lines.append(f"redis CANNOT PERSIST: {failed} (free space on its data volume)")
    for named in snap.get("keys_of_another_type") or []:  # read around: the live workers found by their statuses
        lines += textwrap.wrap(f"KEY OF ANOTHER TYPE (read around: workers found by their statuses): {named}",
                               width, subsequent_indent="  ")
    return [line[:width] for line in lines]


def _curses_loop(stdscr: Any, reader: FleetReader, interval: float, where: str) -> None:
    import curses

    curses.curs_set(0)
    stdscr.timeout(int(interval * 1000))
    prev: Sample | None = None
    while True:
        try:
            now = reader.read()
            body = render(now, prev, width=max(20, stdscr.getmaxyx()[1] - 1))
            prev = now
        except Exception as e:  # noqa: BLE001 (Redis away: say so and keep trying)
            body = [f"cannot read the fleet: {unreadable(e)}; retrying"]
        stdscr.erase()
        height, width = stdscr.getmaxyx()
        header = f"kvfleet top — {where} — every {interval:g}s — q quits"
        for y, line in enumerate([header, ""] + body):
            if y >= height:
                break
            stdscr.addnstr(y, 0, line, max(1, width - 1), curses.A_BOLD if y in (0, 2) else curses.A_NORMAL)
        stdscr.refresh()
        if stdscr.getch() in (ord("q"), ord("Q"), 27):
            return


def run(args: argparse.Namespace) -> int:
    settings = Settings.from_env(redis_url=args.redis_url)
    where = redacted_url(settings.redis_url)
    reader = FleetReader(settings.redis_url)
    try:
        if args.once:
            try:
                first = reader.read()
                time.sleep(args.interval)
                print("\n".join(render(reader.read(), first)))
            except Exception as e:  # noqa: BLE001 (redis errors: name the Redis, never the password)
                print(f"cannot read the fleet from {where}: {unreadable(e)}")
                return 1
            return 0
        import curses

        try:
            curses.wrapper(_curses_loop, reader, args.interval, where)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        reader.close()
