"""Start a whole fleet on this machine (`kvfleet up`): a private Redis (unless --redis-url is given), the
gateway and N workers as child processes. Prints where the API is. Ctrl-C or SIGTERM stops every child (by
PID: SIGTERM, then SIGKILL after a grace period) and the private Redis, leaving nothing running.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from services.redis_server import RedisServer
from shared.settings import Settings, child_env, is_set, redacted_url

# worker flags passed through as they are: (flag, dest)
WORKER_FLAGS = [("--num-kv-blocks", "num_kv_blocks"), ("--kv-cache-memory", "kv_cache_memory"),
                ("--block-size", "block_size"), ("--max-num-seqs", "max_num_seqs"),
                ("--max-num-batched-tokens", "max_num_batched_tokens"), ("--max-model-len", "max_model_len"),
                ("--scheduling-policy", "scheduling_policy"), ("--dtype", "dtype"), ("--device", "device"),
                ("--drain-timeout", "drain_timeout"), ("--log-memory-usage", "log_memory_usage")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, help="how many engine workers")
    p.add_argument("--model", help="HF directory, .gguf file or alias (default smollm2; env KVFLEET_MODEL)")
    p.add_argument("--host", default="127.0.0.1", help='address the gateway listens on')
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway's OpenAI-compatible API")
    p.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    p.add_argument("--routing", help="gateway routing policy (free_blocks, prefix, least_loaded, round_robin)")
    p.add_argument("--api-key", action="append", dest="api_keys", help="require this bearer key (repeatable)")
    p.add_argument("--metrics-port-base", type=int, help="worker i serves /livez, /readyz, /metrics on BASE+i")
    p.add_argument("--docker", action="store_true", help="start the fleet as Docker containers instead")
    for flag, dest in WORKER_FLAGS:
        p.add_argument(flag, dest=dest, help="passed to every worker (see `kvfleet worker --help`)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help='turn off automatic prefix caching on every worker')
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the fleet")


def _child_env(settings: Settings) -> dict[str, str]:
    """Secrets travel in the environment, not argv (which `ps` shows to everyone)."""
    env = child_env(KVFLEET_REDIS_URL=settings.redis_url, PYTHONUNBUFFERED="1")
    if settings.api_keys:
        env["KVFLEET_API_KEYS"] = ",".join(settings.api_keys)
    return env


def fleet_commands(args: argparse.Namespace, settings: Settings, private: bool) -> list[list[str]]:
    cli = [sys.executable, "-m", "services.cli"]
    gateway = cli + ["gateway", "--host", args.host, "--port", str(args.port), "--model", settings.model]
    if args.routing:
        gateway += ["--routing", args.routing]
    cmds = [gateway]
    for i in range(args.workers):
        wid = f"w{i}" if private else f"{os.uname().nodename}-{args.port}-w{i}"
        cmd = cli + ["worker", "--model", settings.model, "--worker-id", wid]
        for flag, dest in WORKER_FLAGS:
            if getattr(args, dest, None) is not None:
                cmd += [flag, str(getattr(args, dest))]
        if not args.enable_prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if args.metrics_port_base is not None:
            cmd += ["--metrics-port", str(args.metrics_port_base + i)]
        cmds.append(cmd)
    return cmds


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float, stopping: list) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def run(args: argparse.Namespace) -> int:
    if args.docker:
        from services.docker_fleet import start_docker_fleet

        return start_docker_fleet(args)
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    settings = Settings.from_env(redis_url=args.redis_url, model=args.model, api_keys=args.api_keys)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    redis_server = None
    procs: list[subprocess.Popen] = []
    code = 0
    try:
        if args.redis_url is None and not is_set("redis_url"):
            redis_server = RedisServer().start()
            settings = settings.with_overrides(redis_url=redis_server.url)
            print(f"kvfleet: private Redis at {redis_server.url} (pid {redis_server.proc.pid})", flush=True)
        env = _child_env(settings)
        for cmd in fleet_commands(args, settings, private=redis_server is not None):
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        print(f"kvfleet: starting gateway (pid {procs[0].pid}) and {args.workers} worker(s) "
              f"({', '.join(str(p.pid) for p in procs[1:])}) serving {settings.model}; Redis "
              f"{redacted_url(settings.redis_url)}", flush=True)
        base = f"http://{args.host}:{args.port}"
        if not _wait_ready(base + "/health", procs, args.startup_timeout, stopping):
            if not stopping:
                print("kvfleet: the fleet did not come up (see the log above)", file=sys.stderr, flush=True)
                code = 1
            return code
        print(f"kvfleet: ready. OpenAI-compatible API at {base}/v1  (model {settings.model!r}; "
              f"try: curl {base}/v1/models). Ctrl-C stops the fleet.", flush=True)
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"kvfleet: process {dead[0].pid} exited with {dead[0].returncode}; stopping the fleet",
                      file=sys.stderr, flush=True)
                code = 1
                break
            time.sleep(0.5)
        return code
    finally:
        print("kvfleet: stopping", flush=True)
        drain = float(args.drain_timeout) if args.drain_timeout is not None else 30.0
        stop_all(procs, grace_s=drain + 5)
        if redis_server is not None:
            redis_server.stop()
        print("kvfleet: stopped", flush=True)
