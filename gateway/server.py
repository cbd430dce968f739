"""Run the OpenAI-compatible HTTP gateway (`kvfleet gateway`): FastAPI under uvicorn.

It tokenizes each prompt (tokenizer only, never weights), routes it by free KV blocks to a worker's Redis
stream, and relays the output. Stateless: run as many replicas as you like against one Redis.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.router import POLICIES
from shared import telemetry
from shared.settings import Settings, hf_offline, redacted_url

KEEP_ALIVE_S = 75  # nginx's keepalive_timeout: above every usual client pool and AWS ALB's 60 s


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
    add_chat_arguments(p)
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let open streams finish")
    p.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S,
                   help="seconds an idle HTTP/1.1 connection is kept open; keep it above the idle timeout of the "
                        "clients' pools and the load balancer in front (httpx 5 s, aiohttp 15 s, AWS ALB 60 s), so "
                        "that they close an idle connection first and never send a request into one the gateway "
                        "is closing (uvicorn's own default, 5 s, races httpx's)")
    p.add_argument("--log-level", default="info", help='uvicorn log level: critical, error, warning, info, debug')


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """The chat flags, as vLLM's server names them (`kvfleet up` passes them to its gateways)."""
    from gateway.tool_parsers import FORMATS

    p.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help='tool_choice "auto" (the default when a request gives tools): the model decides whether to '
                        "call, and its calls are read out of its text by --tool-call-parser (env "
                        "KVFLEET_ENABLE_AUTO_TOOL_CHOICE); without it such requests get a 400")
    p.add_argument("--tool-call-parser", choices=sorted(FORMATS),
                   help="the model's own tool-call format: hermes (<tool_call> JSON: Hermes, Qwen, SmolLM3, and "
                        "ChatML models under --chat-template chatml-tools), mistral ([TOOL_CALLS]), llama3_json "
                        "(Llama 3.1+ JSON calls); env KVFLEET_TOOL_CALL_PARSER")
    p.add_argument("--chat-template", help="a chat template in place of the model's own: a file, Jinja text, or "
                                           "one kvfleet ships (chatml-tools: ChatML that shows the tools, for "
                                           "SmolLM2); env KVFLEET_CHAT_TEMPLATE")


def chat_overrides(args: argparse.Namespace) -> dict[str, object]:
    return {"enable_auto_tool_choice": args.enable_auto_tool_choice, "tool_call_parser": args.tool_call_parser,
            "chat_template": args.chat_template}


def check_chat_settings(settings: Settings) -> None:
    """ValueError naming the flag when the chat settings cannot work: `kvfleet up` asks before it starts anything
    (a gateway itself checks them in create_app)."""
    from gateway.tool_calls import check_settings
    from shared.models import chat_template_text

    check_settings(settings)
    if settings.chat_template:
        try:
            chat_template_text(settings.chat_template)
        except ValueError as e:
            raise ValueError(f"--chat-template: {e}") from None


def chat_flags(args: argparse.Namespace) -> list[str]:
    """The chat flags given to `kvfleet up`, for its gateways' command lines."""
    flags = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    for flag, value in (("--tool-call-parser", args.tool_call_parser), ("--chat-template", args.chat_template)):
        if value:
            flags += [flag, value]
    return flags


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hf_offline()
    settings = Settings.from_env(redis_url=args.redis_url, routing=args.routing, model=args.model,
                                 api_keys=args.api_keys, queue_bound=args.queue_bound,
                                 reserve_blocks=args.reserve_blocks, request_timeout_s=args.request_timeout,
                                 **chat_overrides(args))
    telemetry.setup_tracing("kvfleet-gateway")
    try:
        app = create_app(settings)
    except ValueError as e:  # a setting that cannot work (a chat template, the tool-call parser)
        print(f"kvfleet gateway: {e}", file=sys.stderr)
        return 2
    logging.getLogger("kvfleet.gateway").info(
        "gateway on http://%s:%d/v1 (redis %s, routing %s, %s)", args.host, args.port,
        redacted_url(settings.redis_url), settings.routing,
        f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no API keys")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    timeout_graceful_shutdown=int(args.graceful_timeout), timeout_keep_alive=args.timeout_keep_alive)
    finally:
        telemetry.shutdown()  # on a signal uvicorn exits by re-raising it: the app's lifespan flushes first
    return 0
