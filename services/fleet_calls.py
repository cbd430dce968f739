"""Requests into the fleet without HTTP, for Celery tasks, the Python client and batch files.

It reuses the gateway's pieces, so a request behaves the same whichever door it comes in by: its OpenAI
pydantic models (validation, field limits), prompt preparation (gateway.prompts: tokenizing, context-window
checks, sampling params, batches of prompts), building and placing (gateway.placement.build_request and
place: routing by free KV blocks with reservations and the 429 bound), and its response bodies
(gateway.responses). Around that, a job record
(services.job_record) makes each request id enter the fleet at most once: a caller that comes back with the
same id (a redelivered Celery task, a rerun batch file) attaches to the request or gets its stored result.
So these requests hold no lease (GatewayState.leases is None here): they are jobs that run to the end even
when their caller died, for the retry to attach to; only the gateway's are aborted when their reader is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway import tool_calls
from gateway.chat_api import ChatCompletionRequest
from gateway.errors import APIError, refusal
from gateway.fleet_view import FleetViews
from gateway.openai_api import CompletionRequest
from gateway.placement import (
    OPERATIONS,
    Placement,
    Planned,
    Submitted,
    build_request,
    place,
)
from gateway.prompts import is_short, part_ids, prepare, prompt_count
from gateway.response_models import CompletionResponse
from gateway.responses import chat_body, completion_body, merge_completions
from gateway.state import GatewayState
from gateway.targets import Target, live_view, target_for
from gateway.tokenizer import tokenizers_for
from gateway.tool_calls import ToolCalls
from services import job_record
from services.call_errors import GenerationFailed, InvalidRequest, from_api_error, from_validation_error
from services.job_record import Claim
from shared import streams, telemetry
from shared.fleet_state import FleetView
from shared.messages import GenerationRequest
from shared.settings import Settings

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
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (top N); None: off
    tool_calls: dict[str, Any] | None = None  # chat: how its tool calls are read (gateway.tool_calls.ToolCalls)
    shard: int = 0  # where it was enqueued (shared.keys): its output stream is there
    # its request-stream entry (stream, id) as placed (None: attached to it): a reader back from a Redis outage
    # with no output yet tells from it whether Redis still holds the request (streams.aiter_output)
    entry: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.entry is not None:  # (a job record's JSON gives a list)
            self.entry = (self.entry[0], self.entry[1])


@dataclass
class Call:
    request_id: str
    info: CallInfo
    result: dict[str, Any] | None = None  # the finished body, once known
    parts: list[Call] = field(default_factory=list)  # a completion of several prompts: one call each
    request_hash: str = ""  # request_hash() of the body, kept in its job record


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


def request_hash(kind: str, body: Any) -> str:
    """The request as validated (every field, defaults filled in, the model resolved), canonical JSON, hashed:
    what a request id stands for. Hashing the body, not its token ids, lets an attempt compare without
    tokenizing, so a finished request's result is returned without loading a tokenizer."""
    canonical = json.dumps([kind, body.model_dump(mode="json")], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "backslashreplace")).hexdigest()


def check_same_request(request_id: str, rec: job_record.Record, wanted: str) -> None:
    """409 (InvalidRequest) when `request_id` is already used by a request with another body: never attach to
    it or return its result."""
    if not rec.same_request(wanted):
        raise InvalidRequest(f"request_id: {request_id!r} is already used by a different request (another prompt "
                             "or other parameters); use a new id for a new request", 409, "request_id",
                             "request_id_conflict")


class FleetCaller:
    """Owns an asyncio Redis client and the tokenizers (each loaded once): use it from one event loop."""

    def __init__(self, settings: Settings, redis: Any = None):
        self.settings = settings
        self.redis = redis if redis is not None else streams.connect_async(settings.redis_url,
                                                                           health_check_interval=30)
        tool_calls.check_settings(settings)
        # read afresh for every request (max age 0), and remembering when a worker was last seen live, as the
        # gateway's view does (gateway.targets.live_view waits for those after an outage)
        self.gateway = GatewayState(settings=settings, redis=self.redis, tokenizers=tokenizers_for(settings),
                                    views=FleetViews(max_age_s=0.0))

    async def aclose(self) -> None:
        await self.redis.aclose()
        self.gateway.tokenizers.close()

    async def call(self, kind: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        return await self.result(await self.submit(kind, body, request_id))

    async def submit(self, kind: str, body: dict[str, Any], request_id: str | None = None) -> Call:
        """Validate, then enqueue the request under `request_id` unless that id is already in the fleet (then
        attach to it). A completion with a batch of prompts enqueues one request per prompt, under
        `{request_id}-{i}`. InvalidRequest / FleetUnavailable (429, 503) when it cannot go in.

        The placement is one trace (a root span, as the gateway's server span is for HTTP): the worker
        continues it from the enqueue span."""
        model_cls, prefix = KINDS[kind]
        body = dict(body)
        check_params(model_cls, body)
        view = None  # the fleet, when it was read for the default model: placement reads it once, not twice
        if not body.get("model"):
            view = await live_view(self.gateway)
            body["model"] = self.default_model(view)
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as e:
            raise from_validation_error(e) from None
        rid = request_id or f"{prefix}-{uuid.uuid4().hex}"
        digest = request_hash(kind, parsed)
        parts = part_ids(rid, prompt_count(parsed.prompt) if kind == "completion" else 1)
        attrs = {telemetry.GEN_AI_SYSTEM: telemetry.SYSTEM, telemetry.GEN_AI_OPERATION_NAME: OPERATIONS[prefix],
                 telemetry.GEN_AI_REQUEST_MODEL: parsed.model, telemetry.KVFLEET_REQUEST_ID: rid}
        with telemetry.span("kvfleet.submit", attributes=attrs):
            try:
                records = [await job_record.get(self.redis, part) for part in parts]
                calls: list[Call | None] = [_attached(part, rec, digest) if rec is not None and rec.state != "placing"
                                            else None for part, rec in zip(parts, records, strict=True)]
                if any(c is None for c in calls):
                    planned, info = await self._prepare(kind, parsed, parts, view)
                    for i, p in enumerate(planned):
                        if calls[i] is None:
                            calls[i] = await self._place_once(p, info(p), digest)
            except APIError as e:
                raise from_api_error(e) from None
            except streams.RedisError as e:
                if (refused := refusal(e)) is not None:  # the gateway's 503: a Celery task retries it as a full fleet
                    raise from_api_error(refused) from None
                raise
        done = [c for c in calls if c is not None]
        return done[0] if len(done) == 1 else Call(rid, done[0].info, parts=done, request_hash=digest)

    async def result(self, call: Call) -> dict[str, Any]:
        """The whole response body (OpenAI's shape, JSON-serialisable), stored in the job record."""
        if call.result is not None:
            return call.result
        if call.parts:  # each prompt's body (from its own job record), then one body for the batch
            bodies = [CompletionResponse.model_validate(await self.result(p)) for p in call.parts]
            call.result = merge_completions(call.request_id, bodies).model_dump(mode="json")
            return call.result
        info, s = call.info, self.settings
        chunks = streams.aiter_output(self.redis, call.request_id, info.shard, timeout_s=s.request_timeout_s,
                                      entry=info.entry,
                                      expire_after_s=s.output_ttl_s,  # job_record.finish shortens it
                                      grace_s=s.redis_grace_s)  # then RedisAway/OutputLost: Celery retries
        sub = await self._submitted(call)
        try:
            if info.kind == "completion":
                body = await completion_body(sub, chunks, echo=info.echo, logprobs=info.logprobs,
                                             prompt_top=info.prompt_logprobs)
            else:
                tools = ToolCalls(**info.tool_calls) if info.tool_calls else None
                body = await chat_body(sub, chunks, top_logprobs=info.logprobs, prompt_top=info.prompt_logprobs,
                                       tools=tools)
        except APIError as e:
            raise from_api_error(e) from None
        except streams.KeyOfAnotherType as e:  # its output stream (another program's write): nothing would come
            with contextlib.suppress(streams.RedisError):
                await streams.acancel(self.redis, call.request_id)  # the worker writes past it: stop the work
            raise GenerationFailed(f"request {call.request_id} was cancelled: its output cannot be read. {e}", 503,
                                   None, "redis_key_of_another_type") from None
        except streams.OutputTimeout:
            await streams.acancel(self.redis, call.request_id)
            raise GenerationFailed(f"no output for request {call.request_id} in {s.request_timeout_s:g}s; it was "
                                   "cancelled", 504, None, "timeout") from None
        call.result = body.model_dump(mode="json")
        await job_record.finish(self.redis, call.request_id, info.shard, asdict(info), call.result,
                                ttl_s=s.job_ttl_s, output_ttl_s=s.output_ttl_after_read_s,
                                request_hash=call.request_hash)
        return call.result

    async def cancel(self, request_id: str) -> None:
        await streams.acancel(self.redis, request_id)

    def default_model(self, view: FleetView) -> str:
        """The model the live fleet serves when it serves exactly one, else the configured one."""
        served = {w.model for w in view.live}
        return served.pop() if len(served) == 1 else self.settings.model

    # ---- placing -------------------------------------------------------------------------------
    async def _prepare(self, kind: str, body: Any, parts: list[str], view: FleetView | None
                       ) -> tuple[list[Planned], Any]:
        """What the gateway's endpoints do before placing (gateway.prompts.prepare, then build_request), under
        the given request ids; and a function giving each planned request its CallInfo. `view`: the fleet as
        read already for this request, if it was."""
        tools = None
        if kind == "chat":
            body, tools = tool_calls.for_request(body, self.settings)
        target = await target_for(self.gateway, body.model, view)
        prepared = await self.gateway.tokenizers.run(prepare, target, body, inline=is_short(body))
        planned = [build_request(self.settings, target, p, priority=prepared.priority, request_id=part)
                   for p, part in zip(prepared.prompts, parts, strict=True)]
        tokenizer = (target.workers[0].model_path if target.workers else "") or self.settings.model

        def info(p: Planned) -> CallInfo:
            return CallInfo(kind=kind, model=target.model, tokenizer=tokenizer,
                            request=p.request.model_dump(mode="json"), echo=prepared.echo,
                            logprobs=prepared.logprobs, prompt_logprobs=prepared.prompt_logprobs,
                            tool_calls=asdict(tools) if tools is not None else None)

        return planned, info

    async def _place_once(self, planned: Planned, info: CallInfo, digest: str) -> Call:
        """Claim the id, enqueue, mark it enqueued: inside the admission lock, so the lease only ever spans a few
        Redis round trips. Another attempt's lease: wait for it, then attach (or claim again if it died). A
        request id already used by another request (`digest` differs): 409."""
        r, s, rid = self.redis, self.settings, planned.request.request_id
        while True:
            async with self.gateway.admission:
                claimed = await job_record.claim(r, rid, ttl_s=s.job_ttl_s, lease_s=s.job_lease_s,
                                                 request_hash=digest)
                if claimed.outcome is not Claim.HELD:
                    found = None if claimed.outcome is Claim.FRESH else await streams.arequest_in_fleet(r, rid)
                    if found is None:
                        try:
                            placement = (await place(self.gateway, planned)).placement
                            info.shard, info.entry = placement.shard, (placement.stream, placement.entry_id)
                        except APIError:  # refused before anything was enqueued (429): a retry may place it
                            await job_record.release(r, rid, claimed.lease)
                            raise
                    elif claimed.held is not None and not claimed.held.same_request(digest):
                        await job_record.release(r, rid, claimed.lease)  # the dead attempt enqueued another body
                        check_same_request(rid, claimed.held, digest)
                    else:
                        info.shard = found
                    await job_record.promote(r, rid, claimed.lease, asdict(info), ttl_s=s.job_ttl_s)
                    return Call(rid, info, request_hash=digest)
            rec = claimed.held
            if rec.state == "placing":
                rec = await job_record.wait_placed(r, rid, lease_s=s.job_lease_s)
            if rec is not None:
                return _attached(rid, rec, digest)

    async def _submitted(self, call: Call) -> Submitted:
        """The gateway's view of a placed request, as its response renderers take it."""
        info = call.info
        wants_tokens = info.logprobs is not None or info.prompt_logprobs is not None
        tok = await self.gateway.tokenizers.get(info.tokenizer) if wants_tokens else None
        target = Target(model=info.model, workers=[], view=FleetView(), tokenizer=tok, max_model_len=0,
                        block_size=0, max_total_blocks=0)
        return Submitted(call.request_id, target, GenerationRequest.model_validate(info.request),
                         Placement(None, "", "", info.shard))


def _attached(rid: str, rec: job_record.Record, digest: str) -> Call:
    """The call a job record stands for, if it is this request (`digest`: its request_hash); else 409."""
    assert rec.call is not None, f"job record {rid} in state {rec.state} has no call"
    check_same_request(rid, rec, digest)
    return Call(rid, CallInfo(**rec.call), rec.result if rec.state == "done" else None, request_hash=digest)
