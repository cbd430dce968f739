"""Show the fleet at a glance (`kvfleet status`): one frame of `kvfleet top` from a single read: each live
worker (model, free/total and reserved KV blocks, running, waiting, TTFT, restarts, heartbeat age), dead
workers, stream lengths, pending counts and lag, dead letters. Exit status 1 when Redis cannot be read, or when a
fleet set holds another Redis type (named, with what to do; the fleet serves around it)."""

from __future__ import annotations

import argparse
import json

from services.top import FleetReader, render, unreadable
from shared.settings import Settings, redacted_url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (env KVFLEET_REDIS_URL)")
    p.add_argument("--json", action="store_true", help="print the raw JSON (as GET /v1/fleet does)")


def run(args: argparse.Namespace) -> int:
    settings = Settings.from_env(redis_url=args.redis_url)
    reader = FleetReader(settings.redis_url)
    try:
        sample = reader.read()
    except OSError as e:
        print(f"cannot reach Redis at {redacted_url(settings.redis_url)}: {e}")
        return 1
    except Exception as e:  # redis errors: say which Redis, never the password
        print(f"cannot read the fleet from {redacted_url(settings.redis_url)}: {unreadable(e)}")
        return 1
    finally:
        reader.close()
    print(json.dumps(sample.snap, indent=2) if args.json else "\n".join(render(sample, None)))
    return 1 if sample.snap.get("keys_of_another_type") else 0  # the fleet serves around them: an operator acts
