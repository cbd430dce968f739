"""The OpenAI-shaped response bodies: completions and chat completions (whole, and streamed chunks), their
logprobs and tool calls, /tokenize's and /detokenize's answers, and /v1/models. gateway.responses builds them
from the workers' output chunks."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1: the likeliest token there
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position {token id: PromptLogprob} (the prompt's token and the top N), the
# first None; left out of a response that did not ask (and out of every streamed event)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _absent(value: Any) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_absent)  # absent from a streamed call's later deltas
    arguments: str = ""  # JSON text (a streamed call's: a piece of it per delta)


class ToolCall(BaseModel):
    index: int | None = Field(None, exclude_if=_absent)  # in a streamed delta
    id: str | None = Field(None, exclude_if=_absent)  # absent from a streamed call's later deltas
    type: Literal["function"] | None = Field("function", exclude_if=_absent)
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None



class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(None, exclude_if=_absent)



class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvfleet"
    max_model_len: int | None = None
    workers: int = 0


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
