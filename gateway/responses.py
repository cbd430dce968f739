"""Output chunks -> OpenAI responses: whole bodies (stream false) and server-sent events (stream true, ending
in `data: [DONE]`), for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import APIError
from gateway.logprobs import chat_logprobs, completion_logprobs, joined, prompt_logprobs, vllm_prompt_logprobs
from gateway.placement import Submitted
from gateway.relay import chunk_error
from gateway.response_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
)
from gateway.tool_calls import ToolCalls
from shared.messages import OutputChunk, Usage


def usage_info(usage: Usage | None) -> UsageInfo | None:
    if usage is None:
        return None
    details = {"cached_tokens": usage.cached_tokens} if usage.cached_tokens else None
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens, prompt_tokens_details=details)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None


async def collect(chunks: AsyncIterator[OutputChunk], n: int) -> tuple[list[_Choice], Usage | None]:
    choices = [_Choice() for _ in range(n)]
    usage = None
    async for c in chunks:
        if c.error is not None:
            raise chunk_error(c)
        ch = choices[c.index]
        ch.text.append(c.text)
        ch.token_ids += c.token_ids
        ch.logprobs += c.logprobs or []
        ch.finish_reason = c.finish_reason or ch.finish_reason
        if c.prompt_logprobs is not None:  # once per request, for every choice (they share the prompt)
            for each in choices:
                each.prompt_logprobs, each.prompt_logprob_ranks = c.prompt_logprobs, c.prompt_logprob_ranks
        if c.final:
            usage = c.usage
    return choices, usage


async def completion_body(sub: Submitted, chunks: AsyncIterator[OutputChunk], *, echo: bool,
                          logprobs: int | None, prompt_top: int | None = None) -> CompletionResponse:
    """prompt_top: vLLM's prompt_logprobs as the request asked (None: not asked)."""
    choices, usage = await collect(chunks, sub.num_choices)
    prefix = (sub.request.prompt or "") if echo else ""
    tok, prompt = sub.target.tokenizer, sub.request.prompt_token_ids

    def choice_logprobs(c: _Choice) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = completion_logprobs(tok, c.token_ids, c.logprobs, len(prefix))
        return joined(prompt_logprobs(tok, prompt, c.prompt_logprobs, logprobs), out) if echo else out

    return CompletionResponse(id=sub.request_id, model=sub.target.model, usage=usage_info(usage), choices=[
        CompletionChoice(index=i, text=prefix + "".join(c.text), finish_reason=c.finish_reason,
                         logprobs=choice_logprobs(c), prompt_logprobs=None if prompt_top is None else
                         vllm_prompt_logprobs(tok, prompt, c.prompt_logprobs, c.prompt_logprob_ranks, prompt_top))
        for i, c in enumerate(choices)])


def merge_completions(request_id: str, bodies: list[CompletionResponse]) -> CompletionResponse:
    """A batch's bodies (one per prompt, in prompt order) as one: choices renumbered in order (prompt i's
    choice j is i * n + j), usage summed."""
    if len(bodies) == 1:
        return bodies[0]
    choices = [c.model_copy(update={"index": i}) for i, c in enumerate(c for b in bodies for c in b.choices)]
    usages = [b.usage for b in bodies if b.usage is not None]
    usage = usage_info(sum_usage([Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                        total_tokens=u.total_tokens,
                                        cached_tokens=(u.prompt_tokens_details or {}).get("cached_tokens", 0))
                                  for u in usages])) if usages else None
    return CompletionResponse(id=request_id, created=bodies[0].created, model=bodies[0].model, choices=choices,
                              usage=usage)


def sum_usage(usages: list[Usage]) -> Usage:
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 total_tokens=sum(u.total_tokens for u in usages), cached_tokens=sum(u.cached_tokens for u in usages))


def merge_chunks(streams: list[AsyncGenerator[OutputChunk, None]], n: int) -> AsyncGenerator[OutputChunk, None]:
    """A batch's chunk streams (one per prompt, each with n choices) as one, in arrival order: prompt i's
    choice j becomes index i * n + j; only the last final chunk is final, and carries the summed usage. It
    ends early when one stream does (its client went away); closing it closes them all (so cancels). One
    stream is itself (no layer per chunk)."""
    return streams[0] if len(streams) == 1 else _merged(streams, n)


async def _merged(streams: list[AsyncGenerator[OutputChunk, None]], n: int) -> AsyncGenerator[OutputChunk, None]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, chunks: AsyncGenerator[OutputChunk, None]) -> None:
        try:
            async for c in chunks:
                queue.put_nowait((i, c, None))
        except Exception as e:  # noqa: BLE001 (handed to the reader, which raises it)
            queue.put_nowait((i, None, e))
        else:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    usages: list[Usage] = []
    finished: set[int] = set()
    try:
        while len(finished) < len(streams):
            i, c, err = await queue.get()
            if err is not None:
                raise err
            if c is None:  # that stream ended: past its final chunk, or early (its client went away)
                if i in finished:
                    continue
                return
            if c.final:
                finished.add(i)
                usages += [c.usage] if c.usage is not None else []
            last = c.final and len(finished) == len(streams)
            yield c.model_copy(update={"index": i * n + c.index, "final": last,
                                       "usage": sum_usage(usages) if last and usages else None})
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _message(text: str, model_finish: str | None, tools: ToolCalls | None) -> tuple[ChatMessageOut, str | None]:
    """The assistant's message and finish_reason: its text, or the calls in it (gateway.tool_calls)."""
    if tools is None:
        return ChatMessageOut(content=text), model_finish
    return tools.message(text, model_finish)


async def chat_body(sub: Submitted, chunks: AsyncIterator[OutputChunk], *, top_logprobs: int | None,
                    prompt_top: int | None = None, tools: ToolCalls | None = None) -> ChatCompletionResponse:
    """prompt_top: vLLM's prompt_logprobs as the request asked (over the templated prompt; None: not asked).
    tools: how the answer's tool calls are read (gateway.tool_calls.for_request); None: it is text."""
    choices, usage = await collect(chunks, sub.num_choices)
    tok, prompt = sub.target.tokenizer, sub.request.prompt_token_ids
    messages = [_message("".join(c.text), c.finish_reason, tools) for c in choices]
    return ChatCompletionResponse(id=sub.request_id, model=sub.target.model, usage=usage_info(usage), choices=[
        ChatChoice(index=i, message=messages[i][0], finish_reason=messages[i][1],
                   logprobs=chat_logprobs(tok, c.token_ids, c.logprobs, top_logprobs)
                   if top_logprobs is not None else None, prompt_logprobs=None if prompt_top is None else
                   vllm_prompt_logprobs(tok, prompt, c.prompt_logprobs, c.prompt_logprob_ranks, prompt_top))
        for i, c in enumerate(choices)])


class RunningUsage:
    """vLLM's stream_options.continuous_usage_stats: each streamed chunk carries its choice's usage so far."""

    def __init__(self, sub: Any):
        self._sub = sub  # a Submitted or a Batch (prompt_ids_of)
        self._generated = [0] * sub.num_choices

    def __call__(self, c: OutputChunk) -> UsageInfo:
        self._generated[c.index] += len(c.token_ids)
        prompt, done = len(self._sub.prompt_ids_of(c.index)), self._generated[c.index]
        return UsageInfo(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def sse(obj: Any) -> str:
    payload = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {payload}\n\n"


class TextEvents:
    """The SSE event of a chunk that carries only text (no logprobs, not finished: all but a stream's last
    chunk, usually), from a template the response model renders once per choice with a placeholder for the
    text; per chunk only the text is encoded. A model built and dumped per token was a tenth of the gateway's
    CPU on 64-token streams."""

    SLOT = "kvfleet:text-slot:7b3e"

    def __init__(self, make: Any):
        self._make = make  # (choice index, text) -> the response model of that chunk
        self._parts: dict[int, list[str]] = {}

    def __call__(self, index: int, text: str) -> str:
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = sse(self._make(index, self.SLOT)).split(json.dumps(self.SLOT))
        if len(parts) != 2:  # the placeholder appears elsewhere too (a model named so): the model every time
            return sse(self._make(index, text))
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]


async def _events(chunks: AsyncIterator[OutputChunk], render: Any, usage_event: Any) -> AsyncIterator[str]:
    """Shared SSE loop: one event per chunk, the usage event, [DONE]; an error becomes an error event.
    The last chunk's event, the usage event and [DONE] go out in one write (for a short answer, most of
    what the gateway sends). Closing this stream early (client gone) closes `chunks` at once, which cancels
    the request."""
    tail = ""
    try:
        async for c in chunks:
            if c.error is not None:
                tail = sse(chunk_error(c).body())
                break
            event = render(c) if c.token_ids or c.text or c.finish_reason else ""
            if not c.final:
                if event:
                    yield event
                continue
            tail = event + (usage_event(c.usage) if usage_event is not None else "")
    except APIError as e:
        tail += sse(e.body())
    finally:
        await chunks.aclose()
    yield tail + "data: [DONE]\n\n"


async def completion_events(sub: Any, chunks: AsyncIterator[OutputChunk], *, echo: bool,
                            logprobs: int | None, include_usage: bool,
                            continuous_usage: bool = False) -> AsyncIterator[str]:
    """`sub`: a Submitted, or a Batch whose prompts' chunks `chunks` merges (merge_chunks). continuous_usage:
    every chunk carries its choice's usage so far (vLLM's continuous_usage_stats)."""
    tok, model, rid = sub.target.tokenizer, sub.target.model, sub.request_id
    created = int(time.time())  # one for every chunk of the stream, as OpenAI's
    offsets = [len(sub.prompt_of(i) or "") if echo else 0 for i in range(sub.num_choices)]
    # echo with logprobs: a choice's prompt goes out with its logprobs, which come once per prompt, with the first
    # tokens of any of its choices (so before or with each choice's first chunk)
    echo_later = set(range(sub.num_choices)) if echo and logprobs is not None else set()
    scored: dict[int, list[dict[int, float] | None]] = {}  # prompt (choice // n) -> its logprobs
    if echo and not echo_later:
        for i in range(sub.num_choices):
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
                index=i, text=sub.prompt_of(i) or "")]))

    def echo_event(c: OutputChunk) -> str:
        echo_later.discard(c.index)
        if c.prompt_logprobs is not None:
            scored[c.index // sub.n] = c.prompt_logprobs
        lp = prompt_logprobs(tok, sub.prompt_ids_of(c.index), scored.get(c.index // sub.n), logprobs)
        return sse(CompletionResponse(id=rid, created=created, model=model, choices=[CompletionChoice(
            index=c.index, text=sub.prompt_of(c.index) or "", logprobs=lp)]))

    text_event = TextEvents(lambda i, text: CompletionResponse(id=rid, created=created, model=model, choices=[
        CompletionChoice(index=i, text=text)]))

    running = RunningUsage(sub) if continuous_usage else None

    def render(c: OutputChunk) -> str:
        if logprobs is None and c.finish_reason is None and running is None:
            return text_event(c.index, c.text)
        head = echo_event(c) if c.index in echo_later else ""
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(tok, c.token_ids, c.logprobs or [], offsets[c.index])
            offsets[c.index] += sum(len(s) for s in lp.tokens)
        return head + sse(CompletionResponse(id=rid, created=created, model=model, choices=[
            CompletionChoice(index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason)],
            usage=running(c) if running is not None else None))

    def usage_event(usage: Usage | None) -> str:
        return sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage_info(usage)))

    async for event in _events(chunks, render, usage_event if include_usage else None):
        yield event


async def chat_events(sub: Submitted, chunks: AsyncIterator[OutputChunk], *, top_logprobs: int | None,
                      include_usage: bool, tools: ToolCalls | None = None,
                      continuous_usage: bool = False) -> AsyncIterator[str]:
    """tools: how each choice's tool calls are read (gateway.tool_calls): a forced call goes out whole in one
    delta with its finish; "auto" streams the text and the calls as they are read (no logprobs in that mode).
    continuous_usage: every chunk carries its choice's usage so far (vLLM's continuous_usage_stats)."""
    tok, model, rid = sub.target.tokenizer, sub.target.model, sub.request_id
    created = int(time.time())  # one for every chunk of the stream, as OpenAI's
    for i in range(sub.num_choices):
        prompt = len(sub.prompt_ids_of(i)) if continuous_usage else 0
        yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))],
            usage=UsageInfo(prompt_tokens=prompt, total_tokens=prompt) if continuous_usage else None))

    text_event = TextEvents(lambda i, text: ChatCompletionChunk(id=rid, created=created, model=model, choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(content=text))]))
    calls = [tools.stream() for _ in range(sub.num_choices)] if tools is not None else []
    running = RunningUsage(sub) if continuous_usage else None

    def render(c: OutputChunk) -> str:
        usage = running(c) if running is not None else None  # counted on every chunk, shown where one goes out
        if calls:
            finish = None
            if c.finish_reason is None:
                delta = calls[c.index].feed(c.text)
                if delta is None:
                    return ""
            else:
                delta, finish = calls[c.index].close(c.text, c.finish_reason)
            return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
                index=c.index, delta=delta, finish_reason=finish)], usage=usage))
        if top_logprobs is None and c.finish_reason is None and usage is None:
            return text_event(c.index, c.text)
        lp = chat_logprobs(tok, c.token_ids, c.logprobs or [], top_logprobs) if top_logprobs is not None else None
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[ChatChunkChoice(
            index=c.index, delta=ChatDelta(content=c.text), logprobs=lp, finish_reason=c.finish_reason)],
            usage=usage))

    def usage_event(usage: Usage | None) -> str:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage_info(usage)))

    async for event in _events(chunks, render, usage_event if include_usage else None):
        yield event
