"""The worker's small HTTP server on --metrics-port: GET /livez, /readyz, /metrics (Prometheus text from
a prometheus_client registry, which the metrics code fills). Runs in a daemon thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


class HealthServer:
    """`live()` / `ready()` return (ok, reason); /metrics renders `registry`."""

    def __init__(self, port: int, live: Callable[[], tuple[bool, str]], ready: Callable[[], tuple[bool, str]],
                 *, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif path in ("/livez", "/readyz", "/health"):
                    try:
                        ok, reason = (server.live if path == "/livez" else server.ready)()
                    except Exception as e:  # noqa: BLE001 (a probe that cannot tell is a failed probe)
                        ok, reason = False, f"health check failed: {type(e).__name__}: {e}"
                    self._send(200 if ok else 503, (reason or ("ok" if ok else "not ready")).encode() + b"\n",
                               "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds: keep the log quiet
                pass

        self.live, self.ready, self.registry = live, ready, registry
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kvfleet-health", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
