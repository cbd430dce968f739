"""Tool calls the way vLLM makes them without a model-specific parser: with tool_choice "required" or a named
function, the answer is held by structured outputs to a JSON schema built from the tools
(gateway.openai_api.tool_call_schema), and read back here as OpenAI tool calls.

- a named function: the answer is its arguments (the function's `parameters` schema); one call, finish_reason
  "stop" (as OpenAI's for a forced function);
- "required": the answer is a non-empty array of {"name": one of the tools, "parameters": its arguments}; one
  call each, finish_reason "tool_calls".

tool_choice "auto" (the model decides, in its own format) is refused by the request model: it needs a parser.
"""

from __future__ import annotations

import json
import uuid

from gateway.openai_api import FunctionCall, ToolCall


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_calls(text: str, mode: str) -> list[ToolCall] | None:
    """The calls in an answer held to tool_call_schema; None when it is not whole (cut by max_tokens)."""
    if mode != "required":
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(id=_call_id(), function=FunctionCall(name=mode, arguments=text))]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    return [ToolCall(id=_call_id(), function=FunctionCall(name=item["name"], arguments=json.dumps(item["parameters"])))
            for item in items]


def finish_reason(mode: str, model_finish: str | None, calls: list[ToolCall] | None) -> str | None:
    if calls is None or model_finish != "stop":
        return model_finish
    return "tool_calls" if mode == "required" else "stop"
