"""services.batch's file handling, without a fleet: what a rerun skips, torn lines, per-line errors."""

from __future__ import annotations

import json

import pytest

from services.batch import error_line, load_done, output_line, parse_line, request_id_for, request_of
from services.call_errors import InvalidRequest

pytestmark = pytest.mark.unit


def test_load_done_collects_answered_lines_and_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    answered = output_line("a", "batch-1", {"object": "text_completion"})
    refused = {"custom_id": None, "line": 4, "error": {"code": "invalid_line"}}
    duplicate = {"custom_id": "a", "line": 7, "error": {"code": "duplicate_custom_id"}}
    text = "".join(json.dumps(x) + "\n" for x in (answered, refused, duplicate))
    out.write_text(text + '{"custom_id": "b", "resp')  # killed while writing b
    assert load_done(out) == ({"a"}, {4, 7})
    assert out.read_text() == text  # b is done again by the rerun
    assert load_done(tmp_path / "missing.jsonl") == (set(), set())


def test_parse_line_needs_json_and_a_custom_id():
    assert parse_line('{"custom_id": "x", "body": {}}')["custom_id"] == "x"
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_line("{nope")
    for raw in ('{"body": {}}', '{"custom_id": ""}', '{"custom_id": 3}', "[1]"):
        with pytest.raises(ValueError, match="custom_id"):
            parse_line(raw)


@pytest.mark.parametrize(("line", "param"), [
    ({"url": "/v1/embeddings", "body": {}}, "url"),
    ({"method": "GET", "url": "/v1/completions", "body": {}}, "method"),
    ({"url": "/v1/completions"}, "body"),
    ({"url": "/v1/completions", "body": "prompt"}, "body"),
])
def test_request_of_names_what_is_wrong(line, param):
    with pytest.raises(InvalidRequest) as exc:
        request_of({"custom_id": "x", **line})
    assert exc.value.param == param


def test_request_of_maps_urls_and_drops_stream_false():
    assert request_of({"url": "/v1/chat/completions", "body": {"messages": [], "stream": False}}) == (
        "chat", {"messages": []})
    assert request_of({"method": "post", "url": "/v1/completions", "body": {"prompt": "x"}})[0] == "completion"


def test_output_lines_have_the_openai_batch_shape(tmp_path):
    rid = request_id_for(tmp_path / "out.jsonl", "q1")
    assert rid == request_id_for(tmp_path / "out.jsonl", "q1") != request_id_for(tmp_path / "other.jsonl", "q1")
    ok = output_line("q1", rid, {"id": rid})
    assert ok == {"id": "batch_req_" + rid.removeprefix("batch-"), "custom_id": "q1",
                  "response": {"status_code": 200, "request_id": rid, "body": {"id": rid}}, "error": None}
    bad = error_line("q1", rid, InvalidRequest("temperature: too hot", 400, "temperature", "invalid_value"))
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"] == {"message": "temperature: too hot", "type": "invalid_request_error",
                                                "param": "temperature", "code": "invalid_value"}
    assert bad["error"] == {"code": "invalid_value", "message": "temperature: too hot"}


def test_the_redis_wait_gives_up_on_the_outage_or_on_one_line_that_keeps_failing():
    """_RedisWait: a failure starts the outage and waits; a success ends it. The run gives up once the outage
    outlasts the limit, or once one line has failed for that long while Redis answers the others."""
    import asyncio
    import time

    from services.batch import RedisGone, _RedisWait

    async def scenario() -> None:
        wait = _RedisWait("redis://127.0.0.1:6379/0", limit_s=0.3)
        began = time.monotonic()
        await wait.failed(ConnectionError("refused"), 0, began)  # waits 0.25 s, within the limit
        assert wait.since is not None and time.monotonic() - began >= 0.2
        wait.answered()
        assert wait.since is None
        with pytest.raises(RedisGone, match=r"unreachable for 0s \(--redis-wait 0.3\).*ConnectionError: refused"):
            await wait.failed(ConnectionError("refused"), 3, time.monotonic() - 0.4)  # this line, for 0.4 s
        wait.answered()
        await wait.failed(ConnectionError("down"), 0, time.monotonic())  # a new outage
        await wait.failed(ConnectionError("down"), 1, time.monotonic())  # waits out what is left of the limit
        with pytest.raises(RedisGone, match="ConnectionError: down"):
            await wait.failed(ConnectionError("down"), 2, time.monotonic())

    asyncio.run(scenario())
