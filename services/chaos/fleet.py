"""The fleet under test: a private Redis with AOF (services.redis_server, in a data directory kept across its
restarts), N workers and M gateway replicas as `python -m services.cli ...` children, and a Celery worker
(`celery -A services.celery_app worker`, on the same Redis as broker and result backend), logs in files.

It supervises like `kvfleet up`: a child that exits is started again with the same command (same worker id,
same port) after RESTART_DELAY_S. Exits the injector caused are expected; any other is counted as
a crash. Every process is stopped by PID.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.launcher import stop_all
from services.ports import free_port
from services.redis_server import RedisServer
from shared.settings import child_env

RESTART_DELAY_S = 1.0
CELERY_CONCURRENCY = 8  # tasks the Celery worker runs at once (threads): more than the load's client threads
JOB_TTL_S = 60.0  # a job record outlives any retry of its request in a soak; a day (the default) would fill Redis
STATUS_TTL_S = 3.0  # short, so a SIGSTOP longer than it makes the others take over within seconds
CHILD_SETTINGS = {"KVFLEET_STATUS_TTL_S": str(STATUS_TTL_S), "KVFLEET_HEARTBEAT_S": "0.5",
                  # outputs expire soon after they are read, so Redis memory returns to its baseline in seconds
                  "KVFLEET_OUTPUT_TTL_AFTER_READ_S": "2", "KVFLEET_OUTPUT_TTL_S": "30",
                  # job records (Celery tasks, batch lines, Python client requests) too, a minute after they finish
                  "KVFLEET_JOB_TTL_S": str(JOB_TTL_S),
                  "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


@dataclass
class Child:
    name: str
    role: str  # worker, gateway or celery
    args: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    expect_exit: bool = False  # the injector signalled it: its exit is not a crash
    starts: int = 0
    crashes: list[int] = field(default_factory=list)  # exit codes of the exits nobody caused


class ChaosFleet:
    def __init__(self, model: str, work_dir: Path, *, workers: int = 3, gateways: int = 2,
                 num_kv_blocks: int = 256):
        self.model = model
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.api_key = secrets.token_urlsafe(12)
        self.redis = RedisServer(password=secrets.token_urlsafe(16), data_dir=str(self.work_dir / "redis-data"))
        self.children: dict[str, Child] = {}
        cli = ["-m", "services.cli"]
        for i in range(workers):
            # the last of two or more overlaps its output processing with the next forward (--async-output): the
            # faults meet both step loops
            overlap = ["--async-output"] if workers > 1 and i == workers - 1 else []
            self._add(f"w{i}", "worker", cli + ["worker", "--model", model, "--worker-id", f"w{i}",
                                                "--num-kv-blocks", str(num_kv_blocks), *overlap])
        self.ports = [free_port() for _ in range(gateways)]
        for port in self.ports:
            self._add(f"gateway-{port}", "gateway", cli + ["gateway", "--port", str(port), "--model", model])
        self._add("celery", "celery", ["-m", "celery", "-A", "services.celery_app", "worker", "-n", "chaos@%h",
                                       "--pool=threads", "-c", str(CELERY_CONCURRENCY), "--loglevel=INFO",
                                       "--without-gossip", "--without-mingle", "--without-heartbeat"])
        self.env: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._redis_paused = False
        self._supervisor = threading.Thread(target=self._supervise, name="chaos-supervisor", daemon=True)

    def _add(self, name: str, role: str, args: list[str]) -> None:
        self.children[name] = Child(name, role, args, self.work_dir / f"{name}.log")

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children.values() if c.role == "worker"]

    @property
    def gateways(self) -> list[Child]:
        return [c for c in self.children.values() if c.role == "gateway"]

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> ChaosFleet:
        self.redis.start()
        self.env = child_env(KVFLEET_REDIS_URL=self.redis.url, KVFLEET_API_KEYS=self.api_key, **CHILD_SETTINGS)
        for child in self.children.values():
            self._spawn(child)
        self._supervisor.start()
        self.wait_ready(timeout_s)
        self._wait_celery(timeout_s)
        return self

    def _wait_celery(self, timeout_s: float) -> None:
        """Until the Celery worker logs that it consumes (its first start: the log is appended to)."""
        log = self.children["celery"].log
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if log.exists() and "ready." in log.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the Celery worker was not ready within {timeout_s:g}s; log in {log}\n{self.tail()}")

    def _spawn(self, child: Child) -> None:
        with open(child.log, "ab") as f:
            child.proc = subprocess.Popen([sys.executable, *child.args], env=self.env, stdout=f,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child.starts += 1
        child.expect_exit = False

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            with self._lock:
                exited = [c for c in self.children.values() if c.proc is not None and c.proc.poll() is not None]
            for child in exited:
                if not child.expect_exit:
                    child.crashes.append(child.proc.returncode)
                if self._stopping.wait(RESTART_DELAY_S):
                    return
                with self._lock:
                    self._spawn(child)

    def signal(self, child: Child, sig: int) -> None:
        """Send `sig`; SIGKILL and SIGTERM end it (the supervisor starts it again), SIGSTOP / SIGCONT do not."""
        with self._lock:
            if child.proc is None or child.proc.poll() is not None:
                return
            if sig in (signal.SIGKILL, signal.SIGTERM):
                child.expect_exit = True
            os.kill(child.proc.pid, sig)

    def kill_redis(self) -> None:
        """SIGKILL: no chance to fsync; the AOF keeps what `appendfsync everysec` had written."""
        proc = self.redis.proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.redis.proc = None

    def pause_redis(self) -> None:
        """SIGSTOP: Redis hangs, its connections open; `resume_redis` (SIGCONT) lets it go on."""
        os.kill(self.redis.proc.pid, signal.SIGSTOP)
        self._redis_paused = True

    def resume_redis(self) -> None:
        os.kill(self.redis.proc.pid, signal.SIGCONT)
        self._redis_paused = False

    def start_redis(self) -> None:
        port = self.redis.port
        self.redis.start()
        assert self.redis.port == port, f"redis-server came back on port {self.redis.port}, not {port}"

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join(5)
        procs = [c.proc for c in self.children.values() if c.proc is not None]
        for p in procs:  # a SIGSTOPped child would never see the SIGTERM
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        if self._redis_paused:  # the workers drain through it
            self.resume_redis()
        stop_all(procs, grace_s=15)
        self.redis.stop()

    # ---- probes -----------------------------------------------------------------------------------
    def url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def _live_workers(self) -> list[dict]:
        """The live workers' statuses, as the first gateway sees the fleet ([] when it cannot tell)."""
        try:
            r = httpx.get(self.url(self.ports[0]) + "/v1/fleet", timeout=3,
                          headers={"Authorization": f"Bearer {self.api_key}"})
            return list(r.json()["workers"]) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def registered(self) -> dict[str, int]:
        """worker id -> pid of each worker with a live status."""
        return {w["worker_id"]: w["pid"] for w in self._live_workers()}

    def busy(self) -> dict[str, int]:
        """worker id -> requests it still runs or holds waiting (after the load: work nobody waits for)."""
        return {w["worker_id"]: w["running"] + w["waiting"] for w in self._live_workers()}

    def ready(self) -> bool:
        """Whole: every child running, every gateway healthy, every worker registered by its current process
        (not the status a killed one left behind)."""
        with self._lock:
            if self.gone():
                return False
            pids = {c.name: c.proc.pid for c in self.workers}
        try:
            if not all(httpx.get(self.url(p) + "/health", timeout=3).status_code == 200 for p in self.ports):
                return False
        except httpx.HTTPError:
            return False
        return self.registered() == pids

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"the fleet was not ready within {timeout_s:g}s; logs in {self.work_dir}\n{self.tail()}")

    def gone(self) -> list[str]:
        """Children not running now."""
        return [c.name for c in self.children.values() if c.proc is None or c.proc.poll() is not None]

    def tail(self, lines: int = 15) -> str:
        out = []
        for c in self.children.values():
            text = c.log.read_text(errors="replace").splitlines()[-lines:] if c.log.exists() else []
            out.append(f"---- {c.name} ----\n" + "\n".join(text))
        return "\n".join(out)
