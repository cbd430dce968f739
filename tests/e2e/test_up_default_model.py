"""`kvfleet up` with the default model (alias smollm2): a private Redis, the gateway and a worker come up,
the `openai` client gets a sensible English chat answer (one shaped by a JSON schema, and a forced tool call),
and SIGTERM leaves nothing running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.ports import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kvfleet_up_answers_a_chat_in_english(tmp_path):
    port = free_port()
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        # a modest KV cache: these machines are shared
        # as a vLLM user serves tools: the model's calls read in the Hermes format, shown by a ChatML template
        # that lists the tools (SmolLM2's own does not; without tools it renders the same text)
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--workers", "1", "--port", str(port),
                               "--kv-cache-memory", "256MiB", "--data-dir", str(tmp_path / "redis"),
                               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--chat-template", "chatml-tools"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        deadline = time.monotonic() + 240
        while "kvfleet: ready" not in log.read_text():
            assert up.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/v1" in text
        pids = [int(p) for p in re.findall(r"pid (\d+)", text) + re.findall(r"worker\(s\) \(([\d, ]+)\)", text)[0]
                .split(", ")]
        assert len(pids) == 3  # redis, gateway, one worker
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["workers"] == 1

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        answer = reply.choices[0].message.content
        print(f"\nsmollm2 says: {answer!r}")
        assert "Paris" in answer
        words = re.findall(r"[A-Za-z]+", answer)
        assert len(words) >= 3 and {"the", "is", "of"} & {w.lower() for w in words}
        assert reply.usage.completion_tokens <= 40 and reply.choices[0].finish_reason in ("stop", "length")
        continued = client.chat.completions.create(  # vLLM's continue_final_message: the answer goes on from it
            model="smollm2", temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "The capital of France is"}],
            extra_body={"add_generation_prompt": False, "continue_final_message": True})
        print(f"smollm2 goes on: {continued.choices[0].message.content!r}")
        assert continued.choices[0].message.content.startswith(" Paris")
        schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
                  "required": ["country", "capital"], "additionalProperties": False}
        shaped = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
        print(f"smollm2 in JSON: {shaped.choices[0].message.content!r}")
        fields = json.loads(shaped.choices[0].message.content)
        assert set(fields) == {"country", "capital"} and fields["capital"] == "Paris"
        assert shaped.choices[0].finish_reason == "stop"
        weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                  "additionalProperties": False}}}
        called = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=40, tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
        (call,) = called.choices[0].message.tool_calls
        print(f"smollm2 calls: {call.function.name}({call.function.arguments})")
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        _auto_tool_choice(client, weather)
    finally:
        if up.poll() is None:
            os.kill(up.pid, signal.SIGTERM)
        up.wait(90)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert "kvfleet: stopped" in log.read_text()
    assert not [p for p in pids if _alive(p)], "children left running"


def _auto_tool_choice(client, weather):
    """tool_choice "auto" (the default with tools): the model decides, the gateway reads its Hermes calls. A
    135M model needs one earlier call in the conversation to follow the format; then it calls for the weather and
    answers a joke in text, streamed or not."""
    clock = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
             "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                            "required": ["timezone"]}}}
    shot = [{"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    ask = shot + [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=60, tools=[weather, clock],
                                           messages=ask)
    (call,) = reply.choices[0].message.tool_calls
    print(f"smollm2 calls on its own: {call.function.name}({call.function.arguments})")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
    events = list(client.chat.completions.create(model="smollm2", temperature=0, max_tokens=60,
                                                 tools=[weather, clock], messages=ask, stream=True))
    deltas = [t for e in events for c in e.choices for t in c.delta.tool_calls or []]
    assert {t.index for t in deltas} == {0} and len(deltas) > 2  # its name, then its arguments in pieces
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert json.loads("".join(t.function.arguments for t in deltas)) == {"city": "Paris"}
    assert not "".join(c.delta.content or "" for e in events for c in e.choices)
    with client.chat.completions.stream(model="smollm2", temperature=0, max_tokens=60, tools=[weather, clock],
                                        messages=ask) as stream:  # the client's own accumulation of the deltas
        (whole,) = stream.get_final_completion().choices[0].message.tool_calls
    assert whole.id.startswith("call_") and whole.function.name == "get_weather"
    assert json.loads(whole.function.arguments) == {"city": "Paris"}
    assert [c.finish_reason for e in events for c in e.choices if c.finish_reason] == ["tool_calls"]
    joke = shot + [{"role": "user", "content": "Tell me a joke."}]
    text = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=40, tools=[weather, clock],
                                          messages=joke)
    assert text.choices[0].message.tool_calls is None and len(text.choices[0].message.content) > 10
    streamed = list(client.chat.completions.create(model="smollm2", temperature=0, max_tokens=40,
                                                   tools=[weather, clock], messages=joke, stream=True))
    assert "".join(c.delta.content or "" for e in streamed for c in e.choices) == text.choices[0].message.content
    assert not [c for e in streamed for c in e.choices if c.delta.tool_calls]
