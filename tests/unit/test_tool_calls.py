"""Tool calls (gateway.tool_calls): forced ones through structured outputs (the schema an answer is held to, the
calls read back from it), "auto" ones read out of the model's own format, and the request checks that name
tool_choice."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.chat_api import ChatCompletionRequest, Tool, tool_call_schema
from gateway.errors import APIError, validation_error
from gateway.tool_calls import ToolCalls, check_settings, for_request, merged, read_forced
from shared.settings import Settings

pytestmark = pytest.mark.unit

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [Tool.model_validate(ADD), Tool.model_validate(PING)]


def test_the_schema_is_the_named_functions_parameters_or_an_array_of_calls():
    assert tool_call_schema(TOOLS, "add") == ADD["function"]["parameters"]
    assert tool_call_schema(TOOLS, "ping") == {"type": "object"}  # no parameters: any object
    required = tool_call_schema(TOOLS, None)
    assert required["type"] == "array" and required["minItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in required["items"]["anyOf"]]
    assert names == [["add"], ["ping"]]


def test_forced_calls_are_read_back_whole_or_not_at_all():
    (call,) = read_forced('{"a": 1, "b": 2}', "add")
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    calls = read_forced('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "ping", "parameters": {}}]', None)
    assert [c.name for c in calls] == ["add", "ping"] and json.loads(calls[1].arguments) == {}
    assert read_forced('{"a": 1, "b"', "add") is None and read_forced('[{"name": "add"', None) is None
    message, finish = ToolCalls("named", name="add").message('{"a": 1, "b": 2}', "stop")
    (out,) = message.tool_calls
    assert out.id.startswith("call_") and out.type == "function" and out.function.name == "add"
    assert message.content is None and finish == "stop"
    message, finish = ToolCalls("required").message('[{"name": "ping", "parameters": {}}, {"name": "ping", '
                                                    '"parameters": {}}]', "stop")
    assert finish == "tool_calls" and len({c.id for c in message.tool_calls}) == 2
    message, finish = ToolCalls("named", name="add").message('{"a": 1, "b"', "length")  # cut short: text
    assert message.content == '{"a": 1, "b"' and message.tool_calls is None and finish == "length"


HERMES = ('I will look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_auto_calls_are_read_out_of_the_models_format_with_the_text_around_them():
    message, finish = ToolCalls("auto", parser="hermes").message(HERMES, "stop")
    assert message.content == "I will look." and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("add", {"a": 1, "b": 2}), ("ping", {})]
    assert all(c.index is None for c in message.tool_calls)  # an index only in streamed deltas
    message, finish = ToolCalls("auto", parser="hermes", one_call=True).message(HERMES, "stop")
    assert [c.function.name for c in message.tool_calls] == ["add"]  # parallel_tool_calls false
    message, finish = ToolCalls("auto", parser="hermes").message("No call here.", "stop")
    assert message.content == "No call here." and message.tool_calls is None and finish == "stop"
    message, finish = ToolCalls("auto", parser="hermes").message(HERMES, "length")
    assert len(message.tool_calls) == 2 and finish == "length"  # the model was cut after its calls


def test_auto_calls_stream_their_text_then_each_call_with_an_index():
    """Each call's first delta has its index, id and name; the next ones (index only) its arguments' pieces."""
    stream = ToolCalls("auto", parser="hermes").stream()
    deltas = [stream.feed(HERMES[i:i + 5]) for i in range(0, len(HERMES) - 5, 5)]
    last, finish = stream.close(HERMES[len(deltas) * 5:], "stop")
    deltas = [d for d in deltas + [last] if d is not None]
    assert "".join(d.content or "" for d in deltas) == "I will look."
    pieces = [c for d in deltas for c in d.tool_calls or []]
    firsts = [c for c in pieces if c.id is not None]
    assert [(c.index, c.function.name, c.function.arguments) for c in firsts] == [(0, "add", ""), (1, "ping", "")]
    assert len([c for c in pieces if c.index == 0]) > 2  # the arguments came in pieces
    assert all(c.function.name is None and c.type is None for c in pieces if c.id is None)
    calls = merged(pieces)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                                                   ("ping", {})]
    assert finish == "tool_calls" and all(c.index is None and c.type == "function" for c in calls)
    one = ToolCalls("auto", parser="hermes", one_call=True).stream()
    kept = [c for i in range(0, len(HERMES), 3) if (d := one.feed(HERMES[i:i + 3])) for c in d.tool_calls or []]
    assert {c.index for c in kept} == {0}  # parallel_tool_calls false: the second call's pieces are dropped
    forced = ToolCalls("named", name="add").stream()
    assert forced.feed('{"a": 1,') is None  # a forced call is held to its end
    delta, finish = forced.close(' "b": 2}', "stop")
    assert delta.tool_calls[0].index == 0 and json.loads(delta.tool_calls[0].function.arguments) == {"a": 1, "b": 2}


def test_auto_needs_a_gateway_with_a_parser_and_names_tool_choice():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "tools": [ADD]})
    assert body.tool_mode() == "auto" and body.structured_spec() is None
    with pytest.raises(APIError) as e:
        for_request(body, Settings())
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    same, calls = for_request(body, Settings(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    assert calls == ToolCalls("auto", parser="hermes") and same.skip_special_tokens
    kept, calls = for_request(body.model_copy(update={"parallel_tool_calls": False}),
                              Settings(enable_auto_tool_choice=True, tool_call_parser="mistral"))
    assert calls.one_call and not kept.skip_special_tokens  # [TOOL_CALLS] is a special token: kept in the text
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        check_settings(Settings(enable_auto_tool_choice=True))
    with pytest.raises(ValueError, match="one of hermes"):
        check_settings(Settings(tool_call_parser="xml"))


def test_a_function_named_like_a_mode_is_still_a_named_call():
    auto = {"type": "function", "function": {"name": "auto"}}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "tools": [auto], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "auto"}}})
    _, calls = for_request(body, Settings())
    assert calls == ToolCalls("named", name="auto") and body.structured_spec() == ("tools", {"json": {"type": "object"}})


@pytest.mark.parametrize(("body", "param", "words"), [
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

