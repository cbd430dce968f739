"""A real fleet for tests: a private Redis (shared/redis_server.py), worker processes and gateway processes
started with `python -m services.cli ...`, stopped by PID. Logs go to files; `tail()` shows them on failure.

    with Fleet(model_dir, tmp_path) as fleet:
        fleet.start_worker("w0", "--num-kv-blocks", "64")
        gw = fleet.start_gateway()
        fleet.wait_ready(workers=1)
        client = fleet.client()
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from services.launcher import stop_all
from services.ports import free_port
from services.redis_cluster import RedisCluster
from services.redis_server import RedisServer
from shared import keys, streams
from shared.messages import OutputChunk

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key-0123"


class Fleet:
    def __init__(self, model: str | Path, log_dir: Path, *, redis_password: str | None = "p@ss:word",
                 env: dict[str, str] | None = None, cluster_masters: int = 0):
        """`cluster_masters`: a Redis Cluster of that many masters (services.redis_cluster) instead of one server."""
        self.model = str(model)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = (RedisCluster(cluster_masters, password=redis_password) if cluster_masters
                      else RedisServer(password=redis_password))
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **(env or {}))
        self.workers: dict[str, subprocess.Popen] = {}
        self.gateways: dict[int, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    # ---- processes -----------------------------------------------------------------------------
    def start(self) -> Fleet:
        self.redis.start()
        self.env["KVFLEET_REDIS_URL"] = self.redis.url  # secrets via the environment, as `kvfleet up` does
        return self

    def _spawn(self, name: str, args: list[str], command: list[str] | None = None) -> subprocess.Popen:
        log = self.log_dir / f"{name}.log"
        self.logs[name] = log
        with open(log, "ab") as f:
            return subprocess.Popen([sys.executable, *(command or ["-m", "services.cli"]), *args], cwd=REPO,
                                    env=self.env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start_worker(self, worker_id: str, *flags: str, script: str | None = None) -> subprocess.Popen:
        """`script`: a file of tests/ that runs the worker with hooks (slow_worker.py, fault_worker.py) instead
        of `python -m services.cli worker`."""
        args = ["--model", self.model, "--worker-id", worker_id, *flags]
        proc = (self._spawn(worker_id, ["worker", *args]) if script is None
                else self._spawn(worker_id, args, command=[str(REPO / "tests" / script)]))
        self.workers[worker_id] = proc
        return proc

    def start_gateway(self, *flags: str, api_key: str | None = API_KEY) -> int:
        port = free_port()
        key = ["--api-key", api_key] if api_key else []
        self.gateways[port] = self._spawn(f"gateway-{port}", ["gateway", "--port", str(port), "--model", self.model,
                                                              *key, *flags])
        return port

    def signal_worker(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.workers[worker_id].pid, sig)

    def stop(self) -> None:
        stop_all(list(self.gateways.values()) + list(self.workers.values()), grace_s=15)
        self.redis.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def tail(self, lines: int = 40) -> str:
        out = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"---- {name} ----\n" + "\n".join(text))
        return "\n".join(out)

    # ---- clients -------------------------------------------------------------------------------
    def url(self, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or next(iter(self.gateways))}"

    def client(self, port: int | None = None, **kw: Any):
        import openai

        return openai.OpenAI(base_url=self.url(port) + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def http(self, port: int | None = None, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url(port), headers={"Authorization": f"Bearer {API_KEY}"}, **kw)

    def fleet_status(self, port: int | None = None) -> dict[str, Any]:
        with self.http(port) as h:
            return h.get("/v1/fleet").raise_for_status().json()

    def worker_status(self, worker_id: str, port: int | None = None) -> dict[str, Any]:
        return next(w for w in self.fleet_status(port)["workers"] if w["worker_id"] == worker_id)

    def wait_ready(self, workers: int, timeout_s: float = 180.0) -> None:
        """Every gateway answers /health and `workers` workers are alive."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in {**self.workers, **{str(k): v for k, v in self.gateways.items()}}.items()
                    if p.poll() is not None and (n not in self.workers or p.returncode != -signal.SIGKILL)]
            assert not dead, f"processes exited: {dead}\n{self.tail()}"
            try:
                ok = all(httpx.get(self.url(p) + "/health", timeout=2).status_code == 200 for p in self.gateways)
                if ok and len(self.fleet_status()["workers"]) >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"fleet not ready in {timeout_s}s\n{self.tail()}")

    def wait_for(self, predicate: Any, timeout_s: float = 30.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.tail(15)}")


def run_async(redis_url: str, body: Any) -> Any:
    """asyncio.run(body(r)) with an asyncio client of `redis_url`, closed afterwards."""
    async def main() -> Any:
        r = streams.connect_async(redis_url)
        try:
            return await body(r)
        finally:
            await r.aclose()

    return asyncio.run(main())


def wait_for(predicate: Any, timeout_s: float = 10.0, what: str = "condition", log: Path | None = None) -> Any:
    """The first truthy value of predicate(), polled every 50 ms; AssertionError after timeout_s (with the end
    of `log`, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-4000:] if log else ""
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{tail}" if tail else ""))


def inbox_chunks(r, request_id: str) -> list[OutputChunk]:
    """The chunks of a gateway's request as the workers wrote them (not deduplicated), from whichever gateway
    inbox holds them (kvfleet:{s0}:inbox:*: one entry per worker flush, a JSON array of chunks)."""
    found = []
    for inbox in r.scan_iter(match=keys.inbox("*")):
        for _entry_id, fields in r.xrange(inbox):
            if keys.FIELD in fields:
                found += [OutputChunk.model_validate(c) for c in json.loads(fields[keys.FIELD])
                          if c["request_id"] == request_id]
    return found


STOP_PROMPT = "Numbers: one two three"


def text_and_a_stop_string(client: Any, model: str, prompt: str = STOP_PROMPT) -> tuple[str, str]:
    """A greedy completion's text (16 tokens, `ignore_eos`) and a stop string that begins inside it: its first
    non-blank token from the fourth on."""
    base = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    return base.text, next(t for t in base.logprobs.tokens[3:] if t.strip())


def stream_prompt(i: int) -> str:
    return f"Request number {i}: write down everything you know about the number {i * 7}."


class Stream(threading.Thread):
    """One streamed completion through a fleet's gateway (the openai client, greedy, `ignore_eos`): its text so
    far, chunk count, finish reason, the worker it was routed to (X-Kvfleet-Worker) and the error that ended it."""

    def __init__(self, fleet: Fleet, i: int, max_tokens: int = 64):
        super().__init__(daemon=True)
        self.fleet, self.i, self.max_tokens = fleet, i, max_tokens
        self.text, self.chunks, self.finish, self.worker, self.error = "", 0, None, None, None

    def run(self) -> None:
        try:
            client = self.fleet.client(timeout=120)
            raw = client.completions.with_raw_response.create(
                model=self.fleet.model, prompt=stream_prompt(self.i), max_tokens=self.max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            self.worker = raw.headers["x-kvfleet-worker"]
            for event in raw.parse():
                if event.choices:
                    self.text += event.choices[0].text
                    self.chunks += 1
                    self.finish = event.choices[0].finish_reason or self.finish
        except Exception as e:  # reported by the test
            self.error = e
