"""gateway.responses.TextEvents: a streamed chunk's SSE event from a template is exactly what the response model
itself renders, for any text, and the streams built from it say what the models say."""

import asyncio
import json

import pytest

from gateway.response_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from gateway.responses import TextEvents, chat_events, completion_events, sse
from shared.messages import OutputChunk, Usage

pytestmark = pytest.mark.unit

TEXTS = ["hi", "", " the", "é\"\\\n\t\r\x00\x1f\x7f/<>&\u2028\u2029 😀 中文", TextEvents.SLOT, "data: [DONE]\n\n"]


def completion(i: int, text: str, model: str = "smollm2") -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", created=7, model=model, choices=[CompletionChoice(index=i, text=text)])


def chat(i: int, text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model="smollm2", choices=[
        ChatChunkChoice(index=i, delta=ChatDelta(content=text))])


@pytest.mark.parametrize("make", [completion, chat])
def test_a_template_renders_what_the_model_renders(make):
    events = TextEvents(make)
    for index in (0, 3):
        for text in TEXTS:
            assert events(index, text) == sse(make(index, text))


def test_a_model_named_like_the_placeholder_falls_back_to_the_model():
    def make(i, text):
        return completion(i, text, model=TextEvents.SLOT)

    events = TextEvents(make)
    assert events(0, "x") == sse(make(0, "x"))


class _Sub:
    class target:  # noqa: N801 - a stand-in for a Target's two attributes the events read
        tokenizer = None
        model = "smollm2"

    request_id = "cmpl-9"
    num_choices = 1

    def prompt_of(self, i):
        return "prompt"


async def _chunks():
    for seq, text in enumerate(["Hel", "lo \"w\"", "orld\n"]):
        yield OutputChunk(request_id="r", seq=seq, token_ids=[seq], text=text)
    yield OutputChunk(request_id="r", seq=3, token_ids=[9], text="!", finish_reason="length", final=True,
                      usage=Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6))


def _run(events) -> list[dict]:
    async def take():
        return "".join([e async for e in events])

    body = asyncio.run(take())
    assert body.endswith("data: [DONE]\n\n")
    return [json.loads(e[len("data: "):]) for e in body.split("\n\n") if e and e != "data: [DONE]"]


def test_streams_carry_the_text_the_finish_reason_and_the_usage():
    out = _run(completion_events(_Sub(), _chunks(), echo=False, logprobs=None, include_usage=True))
    assert "".join(c["choices"][0]["text"] for c in out[:-1]) == 'Hello "w"orld\n!'
    assert [c["choices"][0]["finish_reason"] for c in out[:-1]] == [None, None, None, "length"]
    assert out[-1]["choices"] == [] and out[-1]["usage"]["completion_tokens"] == 4
    assert {c["id"] for c in out} == {"cmpl-9"} and {c["object"] for c in out} == {"text_completion"}
    out = _run(chat_events(_Sub(), _chunks(), top_logprobs=None, include_usage=False))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in out[1:]) == 'Hello "w"orld\n!'
    assert out[-1]["choices"][0]["finish_reason"] == "length" and out[-1]["usage"] is None
