"""From an answer's text to OpenAI tool calls, for each tool_choice, as vLLM makes them:

- a named function: the answer is held by structured outputs to the function's `parameters` schema
  (gateway.chat_api.tool_call_schema) and is its arguments; one call, finish_reason "stop" (as OpenAI's for a
  forced function);
- "required": the answer is held to a non-empty array of {"name": one of the tools, "parameters": its
  arguments}; one call each, finish_reason "tool_calls";
- "auto" (the default when tools are given): the model decides, and writes its calls in its own format, which
  the parser the gateway was started with reads (`--enable-auto-tool-choice --tool-call-parser NAME`,
  gateway.tool_parsers); the text around them is the message's content, and finish_reason is "tool_calls" when
  it made any. Without a parser such a request is a 400, as in vLLM.

A forced call cut short (max_tokens) stays text. Streamed, a forced answer goes out whole with its finish; an
"auto" one streams its text, and its calls as the parser gives them (gateway.tool_parsers): a hermes call its
name, then its arguments in pieces; others whole once read.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from gateway.chat_api import ChatCompletionRequest
from gateway.errors import bad_request
from gateway.response_models import ChatDelta, ChatMessageOut, FunctionCall, ToolCall
from gateway.tool_parsers import FORMATS, Call, CallScanner, Piece
from shared.settings import Settings


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: Call, index: int | None = None) -> ToolCall:
    return ToolCall(index=index, id=_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


@dataclass(frozen=True)
class ToolCalls:
    """How one request's answers become calls (kept in a Celery job's record as its fields)."""

    kind: str  # "named" | "required" | "auto"
    name: str = ""  # named: the function
    parser: str = ""  # auto: a gateway.tool_parsers.FORMATS name
    one_call: bool = False  # parallel_tool_calls false: a model's first call only

    def message(self, text: str, model_finish: str | None) -> tuple[ChatMessageOut, str | None]:
        """A whole answer -> the assistant's message and its finish_reason."""
        if self.kind != "auto":
            calls = read_forced(text, self.name or None)
            if calls is None:
                return ChatMessageOut(content=text), model_finish
            finish = model_finish if model_finish != "stop" else ("stop" if self.kind == "named" else "tool_calls")
            return ChatMessageOut(content=None, tool_calls=[_tool_call(c) for c in calls]), finish
        delta, finish = self.stream().close(text, model_finish)
        calls = merged(delta.tool_calls or [])
        if not calls:
            return ChatMessageOut(content=delta.content or ""), finish
        return ChatMessageOut(content=(delta.content or "").strip() or None, tool_calls=calls), finish

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's streamed text -> the deltas to send: a forced call's text is held to its end; an "auto"
    answer's text goes out as it comes, less what may begin a call, and each call as the parser gives it (a call's
    first delta has its index, id and name; the next ones, its index and a piece of its arguments)."""

    def __init__(self, calls: ToolCalls):
        self._calls = calls
        self._scanner = CallScanner(FORMATS[calls.parser]) if calls.kind == "auto" else None
        self._held: list[str] = []
        self._made = 0
        self._piece_index: int | None = None  # the streaming call's index (None: dropped by one_call)

    def feed(self, text: str) -> ChatDelta | None:
        if self._scanner is None:
            self._held.append(text)
            return None
        return self._delta(*self._scanner.feed(text))

    def close(self, text: str, model_finish: str | None) -> tuple[ChatDelta, str | None]:
        """The choice's last text, as it finished -> its last delta and finish_reason."""
        if self._scanner is None:
            message, finish = self._calls.message("".join(self._held) + text, model_finish)
            calls = [c.model_copy(update={"index": k}) for k, c in enumerate(message.tool_calls or [])]
            return ChatDelta(content=message.content, tool_calls=calls or None), finish
        shown, calls = self._scanner.feed(text)
        more_text, more_calls = self._scanner.close()
        delta = self._delta(shown + more_text, calls + more_calls) or ChatDelta(content="")
        return delta, ("tool_calls" if self._made and model_finish == "stop" else model_finish)

    def _delta(self, shown: str, calls: list[Call | Piece]) -> ChatDelta | None:
        out = []
        for c in calls:
            if isinstance(c, Piece) and c.name is None:  # more of the streaming call's arguments
                if self._piece_index is not None:
                    out.append(ToolCall(index=self._piece_index, type=None,
                                        function=FunctionCall(arguments=c.arguments)))
                continue
            if self._calls.one_call and self._made >= 1:
                self._piece_index = None
                continue
            if isinstance(c, Piece):  # a call begins: its id and name
                self._piece_index = self._made
                out.append(ToolCall(index=self._made, id=_call_id(), function=FunctionCall(name=c.name, arguments="")))
            else:
                out.append(_tool_call(c, self._made))
            self._made += 1
        if not shown and not out:
            return None
        return ChatDelta(content=shown or None, tool_calls=out or None)


def merged(deltas: list[ToolCall]) -> list[ToolCall]:
    """Streamed call deltas -> whole calls (as a client accumulates them), without their index."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        k = d.index if d.index is not None else len(calls)
        if k not in calls:
            calls[k] = d.model_copy(update={"index": None, "type": "function"})
        else:
            whole = calls[k]
            calls[k] = whole.model_copy(update={"function": FunctionCall(
                name=whole.function.name, arguments=whole.function.arguments + d.function.arguments)})
    return list(calls.values())


def read_forced(text: str, name: str | None) -> list[Call] | None:
    """The calls in an answer held to tool_call_schema (name None: "required"); None when it is not whole (cut by
    max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if name is not None:
        return [Call(name, text)]
    if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v for v in value):
        return None
    return [Call(item["name"], json.dumps(item.get("parameters", {}))) for item in value]


def check_settings(settings: Settings) -> None:
    """A gateway's tool-call settings make sense (at its start): ValueError saying what to pass."""
    if settings.enable_auto_tool_choice and settings.tool_call_parser not in FORMATS:
        got = f"{settings.tool_call_parser!r} is not one" if settings.tool_call_parser else "it is not given"
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (KVFLEET_TOOL_CALL_PARSER), one of "
                         f"{', '.join(FORMATS)}: {got}")
    if settings.tool_call_parser and settings.tool_call_parser not in FORMATS:
        raise ValueError(f"--tool-call-parser {settings.tool_call_parser!r}: not a parser here; one of "
                         f"{', '.join(FORMATS)}")


def for_request(body: ChatCompletionRequest, settings: Settings
                ) -> tuple[ChatCompletionRequest, ToolCalls | None]:
    """The request as its worker runs it, and its tool calls as this gateway reads them (None: its answer is text).
    A 400 naming tool_choice for "auto" on a gateway without a parser."""
    mode = body.tool_mode()
    if mode is None:
        return body, None
    if mode != "auto":
        return body, ToolCalls(mode, name=body.named_tool() or "")
    if not settings.enable_auto_tool_choice:
        raise bad_request("tool_choice: \"auto\" (the default when tools are given) needs a gateway started with "
                          "--enable-auto-tool-choice and --tool-call-parser NAME (one of "
                          f"{', '.join(FORMATS)}), as vLLM; or send tool_choice \"required\", a named function, "
                          "or \"none\"", "tool_choice")
    calls = ToolCalls("auto", parser=settings.tool_call_parser, one_call=body.parallel_tool_calls is False)
    if FORMATS[calls.parser].keeps_special_tokens:  # its markers are special tokens: keep them in the text
        body = body.model_copy(update={"skip_special_tokens": False})
    return body, calls
