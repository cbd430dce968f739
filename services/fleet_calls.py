"""Requests into the fleet without HTTP, for Celery tasks, the Python client and batch files.

It reuses the gateway's pieces, so a request behaves the same whichever door it comes in by: its OpenAI
pydantic models (validation, field limits), tokenizers and context-window checks (gateway.generation),
routing by free KV blocks with reservations and the 429 bound (gateway.fleet.place, which enqueues through
shared.streams), and its response bodies (gateway.responses). Around that, a job record
(services.job_record) makes each request id enter the fleet at most once: a caller that comes back with the
same id (a redelivered Celery task, a rerun batch file) attaches to the request or gets its stored result.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from gateway import fleet
from gateway.app import completion_prompt
from gateway.errors import APIError, bad_request
from gateway.generation import GatewayState, Submitted, Target, make_params, resolve_max_tokens, target_for
from gateway.openai_api import ChatCompletionRequest, CompletionRequest
from gateway.responses import chat_body, completion_body
from gateway.router import request_blocks
from gateway.tokenizer import Tokenizers, chat_ids
from services import job_record
from services.backend_settings import BackendSettings
from services.call_errors import GenerationFailed, InvalidRequest, from_api_error, from_validation_error
from services.job_record import Claim
from shared import streams
from shared.messages import GenerationRequest, WorkerStatus
from shared.sampling_params import SamplingParams

# kind -> (the gateway's request model, request id prefix)
KINDS: dict[str, tuple[type, str]] = {"completion": (CompletionRequest, "cmpl"),
                                      "chat": (ChatCompletionRequest, "chatcmpl")}


@dataclass
class CallInfo:
    """How to render a request's output; kept in its job record so that any attempt can attach to it."""

    kind: str
    model: str  # the model name answered back
    tokenizer: str  # model path whose tokenizer renders logprobs
    request: dict[str, Any]  # the GenerationRequest as enqueued (JSON)
    echo: bool = False
    logprobs: int | None = None  # completion: logprobs; chat: top_logprobs; None: off


@dataclass
class Call:
    request_id: str
    info: CallInfo
    result: dict[str, Any] | None = None  # the finished body, once known


@dataclass
class _Prepared:
    request: GenerationRequest
    target: Target
    routing_blocks: int
    info: CallInfo

    def serves(self, w: WorkerStatus) -> bool:
        """The workers it may go to: those that serve its model (as the gateway found them)."""
        return any(w.worker_id == t.worker_id for t in self.target.workers)


def check_params(model_cls: type, body: dict[str, Any]) -> None:
    """The gateway ignores unknown fields (OpenAI clients send extras); a task or a script that misspells a
    parameter is told instead."""
    unknown = sorted(set(body) - set(model_cls.model_fields))
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: unknown parameter (accepted: {', '.join(sorted(model_cls.model_fields))})",
                             400, unknown[0], "unknown_parameter")
    if body.get("stream"):
        raise InvalidRequest("stream: not available here; iterate the client's handle (services.client) to "
                             "stream", 400, "stream", "invalid_value")


class FleetCaller:
    """Owns an asyncio Redis client and the tokenizers (each loaded once): use it from one event loop."""

    def __init__(self, settings: BackendSettings, redis: Any = None):
        self.settings = settings
        self.redis = redis if redis is not None else streams.connect_async(settings.redis_url,
                                                                           health_check_interval=30)
        self.gateway = GatewayState(settings=settings, redis=self.redis, tokenizers=Tokenizers())

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def call(self, kind: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        return await self.result(await self.submit(kind, body, request_id))

    async def submit(self, kind: str, body: dict[str, Any], request_id: str | None = None) -> Call:
        """Validate, then enqueue the request under `request_id` unless that id is already in the fleet (then
        attach to it). InvalidRequest / FleetUnavailable (429, 503) when it cannot go in."""
        model_cls, prefix = KINDS[kind]
        body = dict(body)
        check_params(model_cls, body)
        if not body.get("model"):
            body["model"] = await self.default_model()
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        rid = request_id or f"{prefix}-{uuid.uuid4().hex}"
        try:
            rec = await job_record.get(self.redis, rid)
            if rec is not None and rec.state != "placing":
                return _attached(rid, rec)
            return await self._place_once(rid, await self._prepare(kind, parsed, rid))
        except APIError as e:
            raise from_api_error(e) from None

    async def result(self, call: Call) -> dict[str, Any]:
        """The whole response body (OpenAI's shape, JSON-serialisable), stored in the job record."""
        if call.result is not None:
            return call.result
        info, s = call.info, self.settings
        chunks = streams.aiter_output(self.redis, call.request_id, timeout_s=s.request_timeout_s,
                                      expire_after_s=s.output_ttl_s)  # job_record.finish shortens it
        sub = await self._submitted(call)
        try:
            if info.kind == "completion":
                body = await completion_body(sub, chunks, echo=info.echo, logprobs=info.logprobs)
            else:
                body = await chat_body(sub, chunks, top_logprobs=info.logprobs)
        except APIError as e:
            raise from_api_error(e) from None
        except streams.OutputTimeout:
            await streams.acancel(self.redis, call.request_id)
            raise GenerationFailed(f"no output for request {call.request_id} in {s.request_timeout_s:g}s; it was "
                                   "cancelled", 504, None, "timeout") from None
        call.result = body.model_dump(mode="json")
        await job_record.finish(self.redis, call.request_id, asdict(info), call.result, ttl_s=s.job_ttl_s,
                                output_ttl_s=s.output_ttl_after_read_s)
        return call.result

    async def cancel(self, request_id: str) -> None:
        await streams.acancel(self.redis, request_id)

    async def default_model(self) -> str:
        """The model the live fleet serves when it serves exactly one, else the configured one."""
        served = {w.model for w in (await fleet.read_fleet(self.redis)).live}
        return served.pop() if len(served) == 1 else self.settings.model

    # ---- placing -------------------------------------------------------------------------------
    async def _prepare(self, kind: str, body: Any, rid: str) -> _Prepared:
        """What the gateway's endpoints do before enqueuing: find the workers, tokenize, check the window."""
        target = await target_for(self.gateway, body.model)
        tok = target.tokenizer
        if kind == "completion":
            ids, text = completion_prompt(tok, body.prompt)
            max_tokens = resolve_max_tokens(target, len(ids), body.max_tokens, "prompt")
            logprobs, echo = body.logprobs, body.echo
        else:
            try:
                ids = chat_ids(tok, [m.as_template_input() for m in body.messages])
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
            text, echo = None, False
            max_tokens = resolve_max_tokens(target, len(ids), body.max_completion_tokens or body.max_tokens,
                                            "messages")
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = make_params(lambda: body.sampling_params(max_tokens, logprobs))
        request, blocks = self._build_request(target, ids, params, priority=body.priority, prompt=text, rid=rid)
        tokenizer = (target.workers[0].model_path if target.workers else "") or self.settings.model
        info = CallInfo(kind=kind, model=target.model, tokenizer=tokenizer, request=request.model_dump(mode="json"),
                        echo=echo, logprobs=logprobs)
        return _Prepared(request, target, blocks, info)

    def _build_request(self, target: Target, ids: list[int], params: SamplingParams, *, priority: int,
                       prompt: str | None, rid: str) -> tuple[GenerationRequest, int]:
        """gateway.generation.submit's checks and block count, with the caller's request id."""
        if not ids:
            raise bad_request("the prompt is empty: at least one token is needed", "prompt")
        bs = target.block_size
        need_now = request_blocks(len(ids), 1, params.n, bs)
        if target.workers and need_now > target.max_total_blocks:
            raise bad_request(f"the prompt needs {need_now} KV blocks ({len(ids)} tokens, n={params.n}, block size "
                              f"{bs}) but the largest worker's cache has {target.max_total_blocks}", "prompt",
                              "prompt_too_large")
        out_tokens = min(params.max_tokens or 1, self.settings.route_max_output_tokens)
        blocks = min(request_blocks(len(ids), out_tokens, params.n, bs), target.max_total_blocks)
        request = GenerationRequest(request_id=rid, prompt_token_ids=ids, sampling_params=params.to_dict(),
                                    model=target.model, priority=priority, prompt=prompt)
        return request, blocks

    async def _place_once(self, rid: str, prep: _Prepared) -> Call:
        """Claim the id, enqueue, mark it enqueued: inside the admission lock, so the lease only ever spans a few
        Redis round trips. Another attempt's lease: wait for it, then attach (or claim again if it died)."""
        r, s = self.redis, self.settings
        while True:
            async with self.gateway.admission:
                claimed = await job_record.claim(r, rid, ttl_s=s.job_ttl_s, lease_s=s.job_lease_s)
                if claimed.outcome is not Claim.HELD:
                    if claimed.outcome is Claim.FRESH or not await job_record.in_fleet(r, rid):
                        try:
                            await fleet.place(r, s, prep.request, prep.serves, policy=s.routing,
                                              routing_blocks=prep.routing_blocks)
                        except APIError:  # refused before anything was enqueued (429): a retry may place it
                            await job_record.release(r, rid, claimed.lease)
                            raise
                    await job_record.promote(r, rid, claimed.lease, asdict(prep.info), ttl_s=s.job_ttl_s)
                    return Call(rid, prep.info)
            rec = claimed.held
            if rec.state == "placing":
                rec = await job_record.wait_placed(r, rid, lease_s=s.job_lease_s)
            if rec is not None:
                return _attached(rid, rec)

    async def _submitted(self, call: Call) -> Submitted:
        """The gateway's view of a placed request, as its response renderers take it."""
        info = call.info
        tok = await self.gateway.tokenizers.get(info.tokenizer) if info.logprobs is not None else None
        target = Target(model=info.model, workers=[], view=fleet.FleetView(), tokenizer=tok, max_model_len=0,
                        block_size=0, max_total_blocks=0)
        return Submitted(call.request_id, target, GenerationRequest.model_validate(info.request),
                         fleet.Placement(None, "", ""))


def _attached(rid: str, rec: job_record.Record) -> Call:
    assert rec.call is not None, f"job record {rid} in state {rec.state} has no call"
    return Call(rid, CallInfo(**rec.call), rec.result if rec.state == "done" else None)
