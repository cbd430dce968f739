"""Run the OpenAI-compatible HTTP gateway (`kvfleet gateway`): FastAPI under uvicorn.

It tokenizes each prompt (tokenizer only, never weights), routes it by free KV blocks to a worker's Redis
stream, and relays the output. Stateless: run as many replicas as you like against one Redis.
"""

from __future__ import annotations

import argparse
import logging

from gateway.router import POLICIES
from shared import telemetry
from shared.settings import Settings, hf_offline, redacted_url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (redis://, rediss://, with password); env KVFLEET_REDIS_URL")
    p.add_argument("--host", default="127.0.0.1", help='address to listen on (0.0.0.0 to accept other machines)')
    p.add_argument("--port", type=int, default=8000, help='HTTP port of the OpenAI-compatible API')
    p.add_argument("--routing", choices=POLICIES, help="routing policy (default free_blocks; env KVFLEET_ROUTING)")
    p.add_argument("--model", help="model whose tokenizer to load first (default: what the workers report)")
    p.add_argument("--api-key", action="append", dest="api_keys",
                   help="accept this bearer key (repeatable; env KVFLEET_API_KEYS, comma-separated)")
    p.add_argument("--queue-bound", type=int, help="shared-queue length past which requests get 429")
    p.add_argument("--reserve-blocks", type=int, help="free KV blocks to leave on each worker when routing")
    p.add_argument("--request-timeout", type=float, help="seconds without output before a request is cancelled")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let open streams finish")
    p.add_argument("--log-level", default="info", help='uvicorn log level: critical, error, warning, info, debug')


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hf_offline()
    settings = Settings.from_env(redis_url=args.redis_url, routing=args.routing, model=args.model,
                                 api_keys=args.api_keys, queue_bound=args.queue_bound,
                                 reserve_blocks=args.reserve_blocks, request_timeout_s=args.request_timeout)
    telemetry.setup_tracing("kvfleet-gateway")
    app = create_app(settings)
    logging.getLogger("kvfleet.gateway").info(
        "gateway on http://%s:%d/v1 (redis %s, routing %s, %s)", args.host, args.port,
        redacted_url(settings.redis_url), settings.routing,
        f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no API keys")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    timeout_graceful_shutdown=int(args.graceful_timeout))
    finally:
        telemetry.shutdown()  # on a signal uvicorn exits by re-raising it: the app's lifespan flushes first
    return 0
