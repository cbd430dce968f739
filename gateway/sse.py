"""The gateway's streamed HTTP answer (`text/event-stream`): the events are sent from the request's own task,
and a client that goes away cancels that task, which closes the event generator (so its relay cancels the
request on the worker) and ends the answer quietly.

Starlette's StreamingResponse does the same with an anyio task group and two tasks per response; this one
runs one small watcher task beside the request's own. On a 2-core Zen 4 with uvloop and httptools, a FastAPI
endpoint streaming one short answer cost 0.85 ms of CPU per request with StreamingResponse and 0.73 ms with
this (1,000 requests each, one run).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:  # the client's end: anything but a disconnect is read past
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # our own cancel, for a client that left: nothing is left to send
        except OSError:  # the connection broke under a write: the same as leaving
            pass
        finally:
            watcher.cancel()
            if gone:
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
