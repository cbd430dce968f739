"""The generation endpoints' usual request without the web framework: a POST of a JSON body that validates goes
straight to its endpoint function (the same one FastAPI routes to), skipping FastAPI's middleware stack, routing
and dependency solving. Those cost about 0.19 ms of CPU per request (a FastAPI endpoint answering a fixed
stream, 0.29 ms per request, against 0.10 ms for the same answer as a bare ASGI app, under uvicorn on a 2-core
Zen 3): a seventh of a gateway's whole request.

Anything else is handed to the FastAPI app as it came (the body already read is given to it again): another
path or method, a body that is not JSON or does not validate, a request its key check refuses. So every error a
client can cause is still the framework's own answer, and /openapi.json still describes both endpoints. An
error the endpoint itself raises is answered as the app's exception handlers answer it (gateway.errors).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.errors import APIError, named_response


@dataclass(frozen=True)
class Lane:
    body: type[BaseModel]  # what the endpoint takes
    endpoint: Callable[[Any, Request], Awaitable[Any]]  # (body, request) -> a Starlette response
    route: Any  # the app's own route for this path (request metrics are labelled by it)


class FastLane:
    """`FastLane(app, {path: Lane}, authorized)`: `authorized(request)` raises APIError for a refused key."""

    def __init__(self, app: Any, lanes: dict[str, Lane], authorized: Callable[[Request], Awaitable[None]]):
        self.app, self.lanes, self.authorized = app, lanes, authorized

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        lane = self.lanes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if lane is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:  # the client left before its body came: the app answers as it would
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            await self.authorized(request)
            parsed = lane.body.model_validate_json(body)
        except (APIError, ValidationError):  # the app's own answer: 401, or a 400 naming the field
            await self.app(scope, _replay(body, receive), send)
            return
        scope["route"] = lane.route
        try:
            response = await lane.endpoint(parsed, request)
        except Exception as e:  # noqa: BLE001 (answered as the app's handlers answer it)
            response = await named_response(request, e)
        await response(scope, receive, send)


def _is_json(scope: dict) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def _read_body(receive: Any) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """`receive` with the body read already given again first."""
    given = False

    async def replay() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
