"""gateway.fast_lane.FastLane in front of a small FastAPI app with the gateway's error handlers: a JSON POST that
validates reaches its endpoint without the app; everything else (a body that does not validate, a refused key,
another content type, path or method) gets the app's own answer, byte for byte what the app alone answers; an
error the endpoint raises is answered as the app's handlers answer it."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from gateway.errors import APIError, install_handlers
from gateway.fast_lane import FastLane, Lane

pytestmark = pytest.mark.unit


class Body(BaseModel):
    model: str
    n: int = Field(1, ge=1, le=4)


def make(raise_: Exception | None = None) -> tuple[Any, Any, list[str]]:
    """(the app alone, the app behind a FastLane, the paths the app itself was called for)."""
    app = FastAPI()
    install_handlers(app)

    async def authorized(request: Request) -> None:
        if request.headers.get("authorization") != "Bearer k":
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key")

    @app.post("/v1/gen", dependencies=[Depends(authorized)])
    async def gen(body: Body, request: Request) -> JSONResponse:
        if raise_ is not None:
            raise raise_
        return JSONResponse({"model": body.model, "n": body.n, "route": request.scope["route"].path})

    @app.get("/v1/other")
    async def other() -> dict:
        return {"ok": True}

    called: list[str] = []

    async def counted(scope, receive, send):
        if scope["type"] == "http":
            called.append(scope["path"])
        await app(scope, receive, send)

    route = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/v1/gen")
    return app, FastLane(counted, {"/v1/gen": Lane(Body, gen, route)}, authorized), called


AUTH = {"authorization": "Bearer k"}


def test_a_body_that_validates_skips_the_app():
    _, fast, called = make()
    with TestClient(fast) as c:
        r = c.post("/v1/gen", json={"model": "m", "n": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"model": "m", "n": 2, "route": "/v1/gen"}
    assert called == []


@pytest.mark.parametrize("kwargs", [
    {"json": {"model": "m", "n": 9}, "headers": AUTH},  # out of range: a 400 naming the field
    {"json": {"n": 1}, "headers": AUTH},  # missing field
    {"content": b'{"model": "m",', "headers": AUTH | {"content-type": "application/json"}},  # not JSON
    {"content": b'{"model": "\xff"}', "headers": AUTH | {"content-type": "application/json"}},  # not UTF-8
    {"json": {"model": "m"}},  # no key: 401
    {"content": b"model=m", "headers": AUTH | {"content-type": "application/x-www-form-urlencoded"}},
    {"content": b'{"model": "m"}', "headers": AUTH | {"content-type": "text/plain"}},
])
def test_anything_else_gets_the_apps_own_answer(kwargs):
    app, fast, called = make()
    with TestClient(app) as c:
        alone = c.post("/v1/gen", **kwargs)
    with TestClient(fast) as c:
        through = c.post("/v1/gen", **kwargs)
    assert alone.status_code >= 400
    assert (through.status_code, through.content, through.headers.get("www-authenticate")) == \
           (alone.status_code, alone.content, alone.headers.get("www-authenticate"))
    assert called == ["/v1/gen"]


def test_other_paths_and_methods_go_to_the_app():
    _, fast, called = make()
    with TestClient(fast) as c:
        assert c.get("/v1/other").json() == {"ok": True}
        assert c.get("/v1/gen").status_code == 405
    assert called == ["/v1/other", "/v1/gen"]


@pytest.mark.parametrize("error, status, code", [
    (APIError(404, "the model 'x' does not exist", param="model", code="model_not_found"), 404, "model_not_found"),
    (redis.ConnectionError("gone"), 503, "redis_unavailable"),
    (RuntimeError("bug"), 500, None),
])
def test_an_endpoints_error_is_answered_as_the_apps_handlers_answer_it(error, status, code):
    app, fast, called = make(raise_=error)
    with TestClient(fast) as c:
        through = c.post("/v1/gen", json={"model": "m"}, headers=AUTH)
    with TestClient(app, raise_server_exceptions=False) as c:
        alone = c.post("/v1/gen", json={"model": "m"}, headers=AUTH)
    assert through.status_code == alone.status_code == status and called == []
    assert through.json() == alone.json() and through.json()["error"]["code"] == code
