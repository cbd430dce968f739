"""The Python client (services.client): requests straight into the fleet's streams, no HTTP, no Celery. A real
Redis (with a password) and a real fleet worker on the tiny model, one for the module."""

from __future__ import annotations

import asyncio
import json

import pytest
from fleet_harness import Fleet

from services.call_errors import InvalidRequest
from services.client import FleetClient
from shared import keys, streams
from shared.messages import WorkerStatus
from shared.settings import Settings

pytestmark = pytest.mark.integration

BLOCKS = 256


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("client")) as f:
        f.start_worker("w0", "--num-kv-blocks", str(BLOCKS))
        r = streams.connect(f.redis.url)
        f.wait_for(lambda: r.get(keys.status("w0")), 180, "fleet worker w0")
        r.close()
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    with FleetClient(fleet.redis.url) as c:
        yield c


@pytest.fixture
def r(fleet):
    client = streams.connect(fleet.redis.url)
    yield client
    client.close()


def test_submit_and_result(client):
    handle = client.submit("The weather today is", max_tokens=6, temperature=0, ignore_eos=True)
    assert handle.request_id.startswith("cmpl-")
    out = handle.result(timeout=120)
    assert out["id"] == handle.request_id and out["object"] == "text_completion"
    assert out["choices"][0]["text"] and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6
    assert handle.result() == out  # kept


def test_chat_messages(client):
    out = client.submit(messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, logprobs=True,
                        top_logprobs=2).result(timeout=120)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    tokens = out["choices"][0]["logprobs"]["content"]
    assert len(tokens) == out["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 2 for t in tokens)


ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}}}


def test_tool_calls_as_the_gateway_makes_them(fleet, client):
    """A forced call comes back in OpenAI's shape (kept in the job record, so any attempt renders it the same);
    "auto" needs a parser, as on the gateway; with one, an answer without a call (random weights) is text."""
    forced = client.submit(messages=[{"role": "user", "content": "Say hi"}], tools=[ECHO], max_tokens=40,
                           tool_choice={"type": "function", "function": {"name": "echo"}}).result(timeout=120)
    (call,) = forced["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "echo" and set(json.loads(call["function"]["arguments"])) == {"word"}
    with pytest.raises(InvalidRequest) as exc:
        client.submit(messages=[{"role": "user", "content": "Say hi"}], tools=[ECHO], max_tokens=4)
    assert exc.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(exc.value)
    auto = Settings.from_env(redis_url=fleet.redis.url, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with FleetClient(settings=auto) as with_parser:
        out = with_parser.submit(messages=[{"role": "user", "content": "Say hi"}], tools=[ECHO], max_tokens=6,
                                 temperature=0, ignore_eos=True).result(timeout=120)
    choice = out["choices"][0]
    assert choice["message"]["content"] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 6


def test_async_and_sync_iteration_stream_each_chunk_once(client):
    handle = client.submit("Count with me:", max_tokens=12, temperature=0, ignore_eos=True)

    async def consume():
        return [chunk async for chunk in handle]

    chunks = asyncio.run(consume())
    assert [c.seq for c in chunks] == list(range(len(chunks))) and chunks[-1].final
    assert sum(len(c.token_ids) for c in chunks) == 12
    text = "".join(c.text for c in chunks)
    assert text == handle.result(timeout=60)["choices"][0]["text"]
    assert "".join(c.text for c in handle) == text  # the sync iterator reads the same stream again


def test_cancel_stops_the_generation_and_frees_its_blocks(fleet, client, r):
    handle = client.submit("An endless story:", max_tokens=900, ignore_eos=True)
    first = next(iter(handle))
    assert not first.final
    handle.cancel()
    out = handle.result(timeout=120)
    assert out["choices"][0]["finish_reason"] == "abort"
    assert out["usage"]["completion_tokens"] < 900

    def all_free():
        status = WorkerStatus.model_validate_json(r.get(keys.status("w0")))
        return status.running == 0 and status.free_blocks == status.total_blocks

    fleet.wait_for(all_free, 60, "the worker to free the cancelled request's blocks")


def test_same_request_id_attaches_instead_of_generating_again(client, r):
    first = client.submit("Once only", max_tokens=5, ignore_eos=True, request_id="client-once-1")
    out = first.result(timeout=120)
    chunks = streams.read_all_chunks(r, "client-once-1")
    again = client.submit("Once only", max_tokens=5, ignore_eos=True, request_id="client-once-1")
    assert again.result(timeout=10) == out
    assert streams.read_all_chunks(r, "client-once-1") == chunks  # the fleet did not run it again


def test_a_reused_request_id_with_another_body_is_refused(client, r):
    """Same id, other body: 409 InvalidRequest while the first runs and once it is done, never its result; the
    same body still attaches."""
    rid = "client-reuse-1"
    first = client.submit("Mine", max_tokens=3, ignore_eos=True, request_id=rid)
    others = [{"prompt": "Theirs", "max_tokens": 3}, {"prompt": "Mine", "max_tokens": 4},
              {"prompt": "Mine", "max_tokens": 3, "temperature": 0.5}, {"messages": [{"role": "user", "content": "Mine"}]}]
    for i, other in enumerate(others):
        if i == 1:
            out = first.result(timeout=120)  # the rest meet the finished record
        with pytest.raises(InvalidRequest) as exc:
            client.submit(**({"ignore_eos": True} | other), request_id=rid)
        assert exc.value.status_code == 409 and exc.value.param == "request_id", str(exc.value)
        assert exc.value.code == "request_id_conflict" and "already used by a different request" in str(exc.value)
    chunks = streams.read_all_chunks(r, rid)
    assert client.submit("Mine", max_tokens=3, ignore_eos=True, request_id=rid).result(timeout=10) == out
    assert streams.read_all_chunks(r, rid) == chunks


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "model": "gpt-17"}, "model"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"prompt": "x", "top_k": 2**63}, "top_k"),
    ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({}, "prompt"),
])
def test_bad_request_raises_naming_the_field(client, kwargs, field):
    with pytest.raises(InvalidRequest) as exc:
        client.submit(**kwargs)
    assert exc.value.param == field, str(exc.value)


def test_an_attempt_that_died_after_enqueuing_is_not_enqueued_again(fleet, client, r):
    """A previous attempt took the lease, enqueued, and died before marking the request enqueued: the next
    attempt with the same id takes the stale lease over, finds the request in the fleet and attaches."""
    from services import job_record
    from shared.messages import GenerationRequest

    rid = "client-orphan-1"
    r.set(keys.job(rid), job_record.Record(state="placing", since=0.0, owner="dead").dumps())
    # what the dead attempt enqueued: 7 prompt tokens ("Orphan" is 2)
    streams.enqueue(r, GenerationRequest(request_id=rid, prompt_token_ids=[42] * 7,
                                         sampling_params={"max_tokens": 4, "ignore_eos": True}), "w0")
    out = client.submit("Orphan", max_tokens=4, ignore_eos=True, request_id=rid).result(timeout=120)
    assert out["usage"]["prompt_tokens"] == 7 and out["usage"]["completion_tokens"] == 4  # the orphan's output
    chunks = streams.read_all_chunks(r, rid)
    assert [c.seq for c in chunks] == list(range(len(chunks))) and sum(c.final for c in chunks) == 1


def test_an_attempt_that_died_before_enqueuing_is_enqueued_by_the_next(client, r):
    from services import job_record

    rid = "client-orphan-2"
    r.set(keys.job(rid), job_record.Record(state="placing", since=0.0, owner="dead").dumps())
    out = client.submit("Orphan", max_tokens=3, ignore_eos=True, request_id=rid).result(timeout=120)
    assert out["usage"]["completion_tokens"] == 3
    assert job_record.Record.loads(r.get(keys.job(rid))).state == "done"
