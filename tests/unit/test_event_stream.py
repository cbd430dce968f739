"""gateway.sse.EventStream with a hand-driven ASGI receive/send: the events go out in order and the answer
ends; a client that leaves mid-stream closes the event generator at once (its relay then cancels the request)
and the call returns quietly. The [DONE] event goes out with the end of the body."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sse import EventStream

pytestmark = pytest.mark.unit


def test_the_events_go_out_in_order_and_the_answer_ends():
    sent = []

    async def receive():
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    async def events():
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    asyncio.run(EventStream(events(), headers={"X-Request-Id": "r1"})({"type": "http"}, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and headers[b"x-request-id"] == b"r1"
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert [m["more_body"] for m in sent[1:]] == [True, False]  # [DONE] and the end of the body: one write


def test_events_that_never_say_done_end_the_answer_after_the_last():
    sent = []

    async def receive():
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    async def events():
        yield "data: 1\n\n"

    asyncio.run(EventStream(events())({"type": "http"}, receive, send))
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: 1\n\n", True), (b"", False)]


def test_a_client_that_leaves_closes_the_events_and_the_call_returns():
    left = asyncio.Event()
    closed = []

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(_message):
        pass

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()  # waits for output that never comes
            yield "data: never\n\n"
        finally:
            closed.append(True)

    async def go():
        call = asyncio.get_running_loop().create_task(EventStream(events())({"type": "http"}, receive, send))
        await asyncio.sleep(0.01)
        left.set()
        await asyncio.wait_for(call, 2)
        assert not call.cancelled() and call.cancelling() == 0  # it ended on its own, not cancelled

    asyncio.run(go())
    assert closed == [True]
