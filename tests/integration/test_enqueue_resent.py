"""An enqueue whose reply is lost is sent again by redis-py (the gateway's client retries a command on a connection
error): Redis ran it, and runs it again. Against a real Redis, with the reply of the first run dropped as a killed
connection drops it (read, then ConnectionError): the request is enqueued once, its blocks reserved once, and both
runs answer the same entry id. A new call for the same request (placing it again) still enqueues."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions
from redis.asyncio.connection import Connection

from shared import keys, streams
from shared.messages import GenerationRequest, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="tiny", prompt_token_ids=[1, 2, 3],
                             sampling_params=SamplingParams(max_tokens=4).to_dict(), kv_blocks=2, lease=True)


def lose_the_next_script_reply(monkeypatch) -> list[str]:
    """The next EVALSHA's reply is read off the socket, then lost: a ConnectionError as from a killed connection.
    -> the commands sent meanwhile (the resend lands there)."""
    sent: list[str] = []
    send, read = Connection.send_command, Connection.read_response
    state = {"armed": False}

    async def send_command(self, *args, **kw):
        sent.append(str(args[0]))
        state["armed"] = state["armed"] or (str(args[0]).upper() == "EVALSHA" and len(sent) == 1)
        return await send(self, *args, **kw)

    async def read_response(self, *args, **kw):
        reply = await read(self, *args, **kw)
        if state["armed"]:
            state["armed"] = None  # once
            await self.disconnect()
            raise redis.exceptions.ConnectionError("the reply was lost (the connection died after Redis ran it)")
        return reply

    monkeypatch.setattr(Connection, "send_command", send_command)
    monkeypatch.setattr(Connection, "read_response", read_response)
    return sent


@pytest.mark.parametrize("routed", [True, False], ids=["worker-stream", "shared-stream"])
def test_an_enqueue_sent_again_after_its_reply_was_lost_enqueues_once(redis_url, monkeypatch, routed):
    async def enqueue(r, req):
        if routed:
            return await streams.aenqueue_routed(r, req, "w0", 0, min_headroom=0, queue_bound=8, lease_ttl_s=30)
        return await streams.aenqueue_shared(r, req, 0, bound=8, lease_ttl_s=30)

    async def main() -> None:
        r = streams.connect_async(redis_url)
        try:
            await r.flushdb()
            status = WorkerStatus(worker_id="w0", model="tiny", max_model_len=4096, block_size=16, total_blocks=100,
                                  free_blocks=100)
            await r.set(keys.status("w0"), status.model_dump_json())
            stream = keys.req_stream("w0") if routed else keys.req_any(0)
            await enqueue(r, request("warm"))  # the script loaded, a connection open
            await r.delete(stream, keys.reserved("w0"))
            sent = lose_the_next_script_reply(monkeypatch)
            entry = await enqueue(r, request("a"))
            monkeypatch.undo()
            assert [c.upper() for c in sent].count("EVALSHA") == 2  # redis-py did send it again
            entries = await r.xrange(stream)
            assert [e for e, _ in entries] == [entry]  # once, and the id both runs answered
            if routed:
                assert await r.hgetall(keys.reserved("w0")) == {"a": "2"}
            again = await enqueue(r, request("a"))  # a new call: the request placed again on purpose
            assert again != entry and len(await r.xrange(stream)) == 2
        finally:
            await r.aclose()

    asyncio.run(main())
