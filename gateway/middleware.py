"""The gateway's ASGI middleware: counts and times every HTTP request (gateway.metrics) and, when tracing is
on, wraps it in a SERVER span that continues an incoming W3C `traceparent`. The spans of one generation
(routing, enqueue) are made in gateway.placement; its first token and usage are marked by gateway.relay."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import SpanKind

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


def _endpoint(scope: dict) -> str:
    """The route template (bounded label values); "unmatched" for paths no route serves."""
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
