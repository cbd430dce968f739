"""The gateway's FastAPI app: OpenAI-compatible /v1/completions and /v1/chat/completions (SSE when
stream=true), /v1/models (and /v1/models/{id}), /v1/fleet, /health (ready), /livez, /metrics. `create_app(settings)`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import prompts, responses, tool_calls
from gateway.chat_api import ChatCompletionRequest, TokenizeRequest
from gateway.errors import APIError, install_handlers
from gateway.fast_lane import FastLane, Lane
from gateway.fleet_view import FleetViews
from gateway.inbox import Inbox, gateway_id
from gateway.leases import Leases
from gateway.middleware import BodyLimit, Instrumentation
from gateway.openai_api import CompletionRequest, DetokenizeRequest
from gateway.placement import routing_header, submit
from gateway.prompts import is_short, prepare
from gateway.relay import relay
from gateway.response_models import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from gateway.router import POLICIES
from gateway.sse import Disconnect, EventStream
from gateway.state import GatewayState
from gateway.targets import target_for
from gateway.tokenizer import tokenizers_for
from shared import streams, telemetry
from shared.fleet_state import FleetSnapshot
from shared.gc_heap import freeze_startup_heap
from shared.settings import Settings

log = logging.getLogger("kvfleet.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(settings: Settings) -> Any:
    """The gateway's ASGI app: request metrics and tracing (outermost), the body limit, the generation endpoints'
    fast lane (gateway.fast_lane), then the FastAPI app."""
    if settings.routing not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {settings.routing!r}")
    tool_calls.check_settings(settings)
    state = GatewayState(settings=settings, redis=None, tokenizers=tokenizers_for(settings),
                         leases=Leases(settings.lease_ttl_s, max_idle_s=settings.request_timeout_s + 60,
                                       read_out_ttl_s=settings.output_ttl_after_read_s),
                         views=FleetViews(settings.fleet_view_max_age_s))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.redis = streams.connect_async(settings.redis_url, health_check_interval=30,
                                           max_connections=settings.redis_max_connections)
        state.per_request = streams.multiplexed(settings.redis_url)
        reader = None if state.per_request is None else (lambda: streams.multiplexed(settings.redis_url))
        state.inbox = Inbox(state.redis, gateway_id(), ttl_s=settings.output_ttl_after_read_s, reader=reader)
        await state.inbox.start()
        from gateway.tokenizer import resolved_path

        if resolved_path(settings.model):  # warm the default model's tokenizer while workers start
            state.tokenizers.preload(settings.model)
        freeze_startup_heap("gateway")
        yield
        await state.leases.close()
        await state.inbox.close()
        if state.per_request is not None:
            await state.per_request.aclose()
        await state.redis.aclose()
        state.tokenizers.close()
        telemetry.flush()  # the last requests' spans: uvicorn ends the process by re-raising SIGTERM

    # /docs, /redoc and /openapi.json are served below, behind the API key like every other route
    app = FastAPI(title="kvfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvfleet = state
    install_handlers(app)

    async def authorized(request: Request) -> None:  # async: a sync dependency costs a thread hop per request
        if not settings.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and any(hmac.compare_digest(token.encode(), k.encode())
                                                for k in settings.api_keys)
        if not ok:
            raise APIError(401, "Incorrect or missing API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def metrics_authorized(request: Request) -> None:
        """KVFLEET_METRICS_OPEN=1 opens /metrics (only it) to scrapers that cannot send a key."""
        if not settings.metrics_open:
            await authorized(request)

    @app.get("/openapi.json", dependencies=[Depends(authorized)], include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=[Depends(authorized)], include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", dependencies=[Depends(authorized)], include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    async def finish(request: Request, body: Any, headers: dict[str, str]) -> Response:
        """A non-streaming body, cancelled on the worker if the client disconnects first."""
        task = asyncio.ensure_future(body)
        client = Disconnect(request.receive, task)
        try:
            result = await task
        except asyncio.CancelledError:
            if not client.gone:
                raise
            return Response(status_code=499)
        finally:
            client.stop()
        return JSONResponse(result.model_dump(mode="json"), headers=headers)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        target = await target_for(state, body.model)
        prepared = await state.tokenizers.run(prepare, target, body, inline=is_short(body))
        batch = await submit(state, target, prepared, id_prefix="cmpl")
        headers = routing_header(batch)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = responses.merge_chunks([relay(state, s) for s in batch.subs], batch.n)
            events = responses.completion_events(batch, chunks, echo=body.echo, logprobs=body.logprobs,
                                                 include_usage=include_usage,
                                                 continuous_usage=bool(body.stream_options
                                                                       and body.stream_options.continuous()))
            return EventStream(events, headers=headers | SSE_HEADERS)

        async def whole() -> Any:
            parts = [asyncio.ensure_future(responses.completion_body(
                s, relay(state, s), echo=body.echo, logprobs=body.logprobs, prompt_top=body.prompt_logprobs))
                for s in batch.subs]
            try:  # one prompt failing (or the client leaving) cancels the others
                return responses.merge_completions(batch.request_id, list(await asyncio.gather(*parts)))
            finally:
                for part in parts:
                    part.cancel()

        return await finish(request, whole(), headers)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body, tools = tool_calls.for_request(body, settings)
        target = await target_for(state, body.model)
        prepared = await state.tokenizers.run(prepare, target, body, inline=is_short(body))
        batch = await submit(state, target, prepared, id_prefix="chatcmpl")
        sub, top, headers = batch.subs[0], prepared.logprobs, routing_header(batch)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = responses.chat_events(sub, relay(state, sub), top_logprobs=top, include_usage=include_usage,
                                           tools=tools, continuous_usage=bool(body.stream_options
                                                                              and body.stream_options.continuous()))
            return EventStream(events, headers=headers | SSE_HEADERS)
        return await finish(request, responses.chat_body(sub, relay(state, sub), top_logprobs=top,
                                                         prompt_top=body.prompt_logprobs, tools=tools), headers)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's: the token ids of a prompt, or of chat messages through the chat template."""
        target = await target_for(state, body.model)
        return await state.tokenizers.run(prompts.tokenize, target, body)

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's: the text of token ids."""
        target = await target_for(state, body.model)
        return await state.tokenizers.run(prompts.detokenize, target, body)

    async def model_cards() -> dict[str, ModelCard]:
        """The models the live workers serve (the gateway's own when none lives and it queues for one)."""
        view = await streams.aread_fleet(state.redis)
        cards: dict[str, ModelCard] = {}
        for w in view.live:
            card = cards.setdefault(w.model, ModelCard(id=w.model, max_model_len=w.max_model_len))
            card.workers += 1
            card.max_model_len = min(card.max_model_len or w.max_model_len, w.max_model_len)
        if not cards and settings.queue_when_no_workers:
            cards[settings.model] = ModelCard(id=settings.model)
        return cards

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> ModelList:
        return ModelList(data=list((await model_cards()).values()))

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def retrieve_model(model: str) -> ModelCard:
        """OpenAI's "retrieve model" (`client.models.retrieve(id)`): the served model's card, or 404. An id that is
        an absolute path (a model served from its directory) matches with or without its leading slash, which some
        HTTP clients fold into the one before it."""
        cards = await model_cards()
        card = next((c for name, c in cards.items() if name.lstrip("/") == model.lstrip("/")), None)
        if card is None:
            raise APIError(404, f"the model {model!r} does not exist; this fleet serves: "
                                f"{', '.join(sorted(cards)) or 'no model now (no live worker)'}",
                           param="model", code="model_not_found")
        return card

    @app.get("/v1/fleet", dependencies=[Depends(authorized)])
    async def fleet_status() -> dict[str, Any]:  # a FleetSnapshot, served as it is
        return dict(await streams.afleet_snapshot(state.redis))

    @app.get("/health")
    @app.get("/readyz")
    async def health() -> JSONResponse:
        try:
            await streams.aping(state.redis)
            view = await streams.aread_fleet(state.redis)
        except Exception as e:  # noqa: BLE001 (any Redis trouble means: not ready)
            return JSONResponse({"status": "unavailable", "reason": f"redis: {type(e).__name__}"}, 503)
        if not view.live:
            return JSONResponse({"status": "unavailable", "reason": "no live worker"}, 503)
        return JSONResponse({"status": "ok", "workers": len(view.live)})

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/metrics", dependencies=[Depends(metrics_authorized)])
    async def metrics() -> Response:
        try:
            snap: FleetSnapshot | None = await streams.afleet_snapshot(state.redis)
        except Exception as e:  # noqa: BLE001 (any Redis trouble: scrape what the gateway itself knows)
            log.warning("metrics: cannot read the fleet from Redis: %s", type(e).__name__)
            snap = None
        state.metrics.refresh(snap)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    posts = {r.path: r for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods}
    fast = FastLane(app, {"/v1/completions": Lane(CompletionRequest, completions, posts["/v1/completions"]),
                          "/v1/chat/completions": Lane(ChatCompletionRequest, chat_completions,
                                                       posts["/v1/chat/completions"])}, authorized)
    return Instrumentation(BodyLimit(fast, max_bytes=settings.max_body_bytes), metrics=state.metrics)

