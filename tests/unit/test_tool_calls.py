"""Tool calls through structured outputs (gateway.tool_calls): the schema an answer is held to, the calls read
back from it, and the request checks that name tool_choice."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.errors import validation_error
from gateway.openai_api import ChatCompletionRequest, Tool, tool_call_schema
from gateway.tool_calls import finish_reason, read_calls

pytestmark = pytest.mark.unit

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [Tool.model_validate(ADD), Tool.model_validate(PING)]


def test_the_schema_is_the_named_functions_parameters_or_an_array_of_calls():
    assert tool_call_schema(TOOLS, "add") == ADD["function"]["parameters"]
    assert tool_call_schema(TOOLS, "ping") == {"type": "object"}  # no parameters: any object
    required = tool_call_schema(TOOLS, "required")
    assert required["type"] == "array" and required["minItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in required["items"]["anyOf"]]
    assert names == [["add"], ["ping"]]


def test_calls_are_read_back_whole_or_not_at_all():
    (call,) = read_calls('{"a": 1, "b": 2}', "add")
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert call.id.startswith("call_") and call.type == "function"
    calls = read_calls('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "ping", "parameters": {}}]',
                       "required")
    assert [c.function.name for c in calls] == ["add", "ping"] and json.loads(calls[1].function.arguments) == {}
    assert len({c.id for c in calls}) == 2
    assert read_calls('{"a": 1, "b"', "add") is None and read_calls('[{"name": "add"', "required") is None
    assert finish_reason("add", "stop", [call]) == "stop" and finish_reason("required", "stop", calls) == "tool_calls"
    assert finish_reason("add", "length", None) == "length"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [ADD]}, "tool_choice", "auto"),
    ({"tools": [ADD], "tool_choice": "auto"}, "tool_choice", "parser"),
    ({"tool_choice": "required"}, "tools", "required"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice.function.name",
     "not one of the tools"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot also"),
])
def test_requests_that_cannot_be_served_name_the_field(body, param, words):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]} | body)
    got_param, message = validation_error(e.value)
    assert got_param == param and words in message, (got_param, message)


def test_tool_choice_none_leaves_the_answer_free():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[ADD],
                                 tool_choice="none")
    assert body.tool_mode() is None and body.sampling_params(8, None).structured_outputs is None
