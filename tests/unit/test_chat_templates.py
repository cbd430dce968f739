"""Chat templates (shared.models.chat_template_text, shared/chat_templates): what --chat-template accepts, and the
`chatml-tools` template kvfleet ships: SmolLM2's own ChatML when no tools are given, the tools and the earlier
calls and their results in the Hermes format when they are. And a request's template options (vLLM's
add_generation_prompt, continue_final_message, chat_template_kwargs)."""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from gateway.chat_api import ChatCompletionRequest
from shared.models import chat_template_text

pytestmark = pytest.mark.unit

# SmolLM2-135M-Instruct's own chat template (its tokenizer_config.json)
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def render(template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    out = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True)
    return out[0][0]


def test_a_shipped_name_a_file_or_jinja_text(tmp_path):
    shipped = chat_template_text("chatml-tools")
    assert "<tool_call>" in shipped
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_text(str(path)) == "{{ messages[0]['content'] }}"
    assert chat_template_text("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="not a file .* chatml-tools"):
        chat_template_text("no-such-template")
    with pytest.raises(ValueError, match="line 1"):
        chat_template_text("{% for m in messages %}")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "q"}],
])
def test_chatml_tools_is_smollm2s_own_template_without_tools(messages):
    assert render(chat_template_text("chatml-tools"), messages) == render(SMOLLM2, messages)


def test_chatml_tools_shows_the_tools_the_calls_and_their_results():
    messages = [{"role": "user", "content": "Weather in Rome and Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "3 C"}]
    text = render(chat_template_text("chatml-tools"), messages, [WEATHER])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>\n{"name": "get_weather", "description": "Weather in a city", "parameters"' in system
    assert rest == ("<|im_start|>user\nWeather in Rome and Oslo?<|im_end|>\n"
                    "<|im_start|>assistant\n"
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
                    "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n"
                    "<tool_response>\n3 C\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_chat_template_options_reach_the_template():
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "assistant", "content": "Once"}], "add_generation_prompt": False,
        "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert body.template_options() == {"enable_thinking": False, "add_generation_prompt": False,
                                       "continue_final_message": True}
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert plain.template_options() == {"add_generation_prompt": True, "continue_final_message": False}
