"""The gateway's FastAPI app: OpenAI-compatible /v1/completions and /v1/chat/completions (SSE when
stream=true), /v1/models, /v1/fleet, /health (ready), /livez, /metrics. `create_app(settings)`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import fleet, responses
from gateway.errors import APIError, bad_request, install_handlers
from gateway.generation import (
    GatewayState,
    make_params,
    relay,
    resolve_max_tokens,
    routing_header,
    submit,
    target_for,
    watch_disconnect,
)
from gateway.instrumentation import Instrumentation
from gateway.openai_api import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.router import POLICIES
from gateway.tokenizer import Tokenizers, chat_ids, prompt_ids
from shared import streams, telemetry
from shared.settings import Settings

log = logging.getLogger("kvfleet.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(settings: Settings) -> FastAPI:
    if settings.routing not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {settings.routing!r}")
    state = GatewayState(settings=settings, redis=None, tokenizers=Tokenizers())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.redis = streams.connect_async(settings.redis_url, health_check_interval=30)
        from gateway.tokenizer import resolved_path

        if resolved_path(settings.model):  # warm the default model's tokenizer while workers start
            state.tokenizers.preload(settings.model)
        yield
        await state.redis.aclose()
        telemetry.flush()  # the last requests' spans: uvicorn ends the process by re-raising SIGTERM

    app = FastAPI(title="kvfleet gateway", lifespan=lifespan)
    app.state.kvfleet = state
    install_handlers(app)
    app.add_middleware(Instrumentation, metrics=state.metrics)

    def authorized(request: Request) -> None:
        if not settings.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and any(hmac.compare_digest(token.encode(), k.encode())
                                                for k in settings.api_keys)
        if not ok:
            raise APIError(401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def finish(request: Request, body: Any, headers: dict[str, str]) -> Response:
        """A non-streaming body, cancelled on the worker if the client disconnects first."""
        task = asyncio.ensure_future(body)
        watcher = asyncio.ensure_future(watch_disconnect(request, task))
        try:
            result = await task
        except asyncio.CancelledError:
            if not await request.is_disconnected():
                raise
            return Response(status_code=499)
        finally:
            watcher.cancel()
        return JSONResponse(result.model_dump(mode="json"), headers=headers)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        target = await target_for(state, body.model)
        ids, text = completion_prompt(target.tokenizer, body.prompt)
        max_tokens = resolve_max_tokens(target, len(ids), body.max_tokens, "prompt")
        params = make_params(lambda: body.sampling_params(max_tokens, body.logprobs))
        sub = await submit(state, target, ids, params, priority=body.priority, prompt=text, id_prefix="cmpl")
        headers = routing_header(sub)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = responses.completion_events(sub, relay(state, sub, request.is_disconnected), echo=body.echo,
                                                 logprobs=body.logprobs, include_usage=include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers | SSE_HEADERS)
        return await finish(request, responses.completion_body(sub, relay(state, sub), echo=body.echo,
                                                               logprobs=body.logprobs), headers)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        target = await target_for(state, body.model)
        try:
            ids = chat_ids(target.tokenizer, [m.as_template_input() for m in body.messages])
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        wanted = body.max_completion_tokens or body.max_tokens
        max_tokens = resolve_max_tokens(target, len(ids), wanted, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = make_params(lambda: body.sampling_params(max_tokens, top))
        sub = await submit(state, target, ids, params, priority=body.priority, prompt=None, id_prefix="chatcmpl")
        headers = routing_header(sub)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = responses.chat_events(sub, relay(state, sub, request.is_disconnected), top_logprobs=top,
                                           include_usage=include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers | SSE_HEADERS)
        return await finish(request, responses.chat_body(sub, relay(state, sub), top_logprobs=top), headers)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> ModelList:
        view = await fleet.read_fleet(state.redis)
        cards: dict[str, ModelCard] = {}
        for w in view.live:
            card = cards.setdefault(w.model, ModelCard(id=w.model, max_model_len=w.max_model_len))
            card.workers += 1
            card.max_model_len = min(card.max_model_len or w.max_model_len, w.max_model_len)
        if not cards and settings.queue_when_no_workers:
            cards[settings.model] = ModelCard(id=settings.model)
        return ModelList(data=list(cards.values()))

    @app.get("/v1/fleet", dependencies=[Depends(authorized)])
    async def fleet_status() -> dict[str, Any]:
        return await fleet.snapshot(state.redis)

    @app.get("/health")
    @app.get("/readyz")
    async def health() -> JSONResponse:
        try:
            await state.redis.ping()
            view = await fleet.read_fleet(state.redis)
        except Exception as e:  # noqa: BLE001 (any Redis trouble means: not ready)
            return JSONResponse({"status": "unavailable", "reason": f"redis: {type(e).__name__}"}, 503)
        if not view.live:
            return JSONResponse({"status": "unavailable", "reason": "no live worker"}, 503)
        return JSONResponse({"status": "ok", "workers": len(view.live)})

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/metrics")
    async def metrics() -> Response:
        await state.metrics.refresh(state.redis)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def completion_prompt(tokenizer: Any, prompt: Any) -> tuple[list[int], str | None]:
    """A completion's prompt (text, token ids, or a batch of one of either) -> (token ids, text or None)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"batched prompts are not supported (got {len(prompt)}); send one prompt per "
                              "request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt_ids(tokenizer, prompt), prompt
    vocab = len(tokenizer)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", "prompt")
    return list(prompt), None
