"""Show the fleet at a glance (`kvfleet status`): each live worker (model, free/total KV blocks, running,
waiting, heartbeat age), dead workers, stream lengths and pending counts, dead letters."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from shared.settings import Settings, redacted_url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (env KVFLEET_REDIS_URL)")
    p.add_argument("--json", action="store_true", help="print the raw JSON (as GET /v1/fleet does)")


async def _snapshot(url: str) -> dict[str, Any]:
    from gateway import fleet
    from shared import streams

    r = streams.connect_async(url)
    try:
        return await fleet.snapshot(r)
    finally:
        await r.aclose()


def render(snap: dict[str, Any]) -> str:
    lines = [f"{'WORKER':<22} {'MODEL':<28} {'FREE/TOTAL BLOCKS':>18} {'RESERVED':>8} {'RUN':>4} {'WAIT':>4} "
             f"{'PREEMPT':>7} {'HEARTBEAT':>9}"]
    for w in snap["workers"]:
        model = w["model"] if len(w["model"]) <= 28 else "…" + w["model"][-27:]
        flag = " (draining)" if w["draining"] else ""
        lines.append(f"{w['worker_id']:<22} {model:<28} {w['free_blocks']:>8}/{w['total_blocks']:<9} "
                     f"{w['reserved_blocks']:>8} {w['running']:>4} {w['waiting']:>4} {w['num_preemptions']:>7} "
                     f"{w['heartbeat_age_s']:>8.1f}s{flag}")
    if not snap["workers"]:
        lines.append("(no live worker)")
    if snap["dead_workers"]:
        lines.append(f"dead workers (their requests are being taken over): {', '.join(snap['dead_workers'])}")
    lines.append("")
    lines.append(f"{'STREAM':<40} {'LENGTH':>8} {'PENDING':>8}")
    for name, info in snap["streams"].items():
        lines.append(f"{name:<40} {info['length']:>8} {info['pending']:>8}")
    lines.append(f"dead letters: {snap['dead_letters']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    settings = Settings.from_env(redis_url=args.redis_url)
    try:
        snap = asyncio.run(_snapshot(settings.redis_url))
    except OSError as e:
        print(f"cannot reach Redis at {redacted_url(settings.redis_url)}: {e}")
        return 1
    except Exception as e:  # redis errors: say which Redis, never the password
        print(f"cannot read the fleet from {redacted_url(settings.redis_url)}: {type(e).__name__}: {e}")
        return 1
    print(json.dumps(snap, indent=2) if args.json else render(snap))
    return 0
