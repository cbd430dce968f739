"""Celery worker processes for tests, next to a fleet from fleet_harness: `celery -A services.celery_app
worker` with the fleet's environment (its Redis URL, password included), logging to a file the fleet's
`tail()` shows, stopped or killed by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from fleet_harness import REPO, Fleet


class CeleryWorker:
    def __init__(self, fleet: Fleet, name: str, *, queues: str = "celery", pool: str = "threads",
                 concurrency: int = 8, env: dict[str, str] | None = None):
        self.fleet, self.name = fleet, name
        self.args = ["-A", "services.celery_app", "worker", "-n", f"{name}@%h", "-Q", queues, f"--pool={pool}",
                     "-c", str(concurrency), "--loglevel=INFO", "--without-gossip", "--without-mingle",
                     "--without-heartbeat"]
        self.env = dict(fleet.env, **(env or {}))
        self.log_path = fleet.log_dir / f"celery-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> CeleryWorker:
        self.fleet.logs[f"celery-{self.name}"] = self.log_path
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "celery", *self.args], cwd=REPO, env=self.env,
                                         stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120.0) -> CeleryWorker:
        def ready() -> bool:
            assert self.proc.poll() is None, f"celery worker {self.name} exited\n{self.fleet.tail()}"
            return "ready." in self.log()

        self.fleet.wait_for(ready, timeout_s, f"celery worker {self.name}")
        return self

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> CeleryWorker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
