"""The gateway's ASGI middleware: counts and times every HTTP request (gateway.metrics) and, when tracing is
on, wraps it in a SERVER span that continues an incoming W3C `traceparent`. The spans of one generation
(routing, enqueue) are made in gateway.placement; its first token and usage are marked by gateway.relay.
BodyLimit answers 413 to a body over `max_body_bytes` before anything parses it or checks its API key."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import SpanKind

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from shared import telemetry as t


class Instrumentation:
    """`app.add_middleware(Instrumentation, metrics=...)`."""

    def __init__(self, app: Any, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if t.enabled():
                await self._traced(scope, receive, send_status, lambda: status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe_http(_endpoint(scope), status, time.perf_counter() - start)

    async def _traced(self, scope: dict, receive: Any, send: Any, status: Any) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        method = scope.get("method", "GET")
        with t.span(f"{method} {scope.get('path', '')}", context=t.extract(headers), kind=SpanKind.SERVER,
                    attributes={"http.request.method": method, "url.path": scope.get("path", ""),
                                "url.scheme": scope.get("scheme", "http")}) as span:
            try:
                await self.app(scope, receive, send)
            finally:
                route = _endpoint(scope)
                span.update_name(f"{method} {route}")
                span.set_attributes({"http.route": route, "http.response.status_code": status()})
                if status() >= 500:
                    t.set_error(span, f"HTTP {status()}")


class _TooLarge(Exception):
    pass


class BodyLimit:
    """`app.add_middleware(BodyLimit, max_bytes=...)`: 413 in OpenAI's error shape for a request body over
    `max_bytes`. A Content-Length over it is answered at once, without calling the app (one within it is let
    through as it is); a body without one (chunked) is counted as the app reads it, and the app's answer
    (whatever it made of the cut-off read) is replaced by the 413."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _error(self, size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this gateway takes at most {self.max_bytes} "
                             "(KVFLEET_MAX_BODY_BYTES)", code="request_too_large")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length", b"")
        if length.isdigit() and b"transfer-encoding" not in headers:
            if int(length) > self.max_bytes:
                await self._error(length.decode()).response()(scope, receive, send)
            else:  # the HTTP parser hands on exactly Content-Length bytes: nothing to count
                await self.app(scope, receive, send)
            return
        seen = 0
        tripped = started = False

        async def counted() -> dict:
            nonlocal seen, tripped
            if tripped:
                raise _TooLarge
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    tripped = True
                    raise _TooLarge
            return message

        async def send_unless_tripped(message: dict) -> None:
            nonlocal started
            if tripped:  # the app answered a body it could not read whole: the 413 goes instead
                if not started:
                    started = True
                    await self._error(f"more than {self.max_bytes}").response()(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, send_unless_tripped)
        except _TooLarge:
            await send_unless_tripped({"type": "http.response.start"})


def _endpoint(scope: dict) -> str:
    """The route template (bounded label values); "unmatched" for paths no route serves."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
