"""Start a whole fleet on this machine (`kvfleet up`): a private Redis (unless --redis-url is given), the
gateway and N workers as child processes. Prints where the API is.

It supervises them: a child that exits (a worker or the gateway) is started again with the same command (same
worker id, same port) after a backoff (services.supervisor: 1 s doubling to 30 s), and the launcher prints why
it ended; the rest of the fleet keeps serving meanwhile. A child in a crash loop (it exits again after 5
restarts within 60 s) stays down, with a message saying so. The private Redis (services.private_redis: AOF in
--data-dir, a random password, 127.0.0.1) that dies is started again on the same port and data; if that fails,
or it is in a crash loop, the fleet stops. Otherwise only Ctrl-C or SIGTERM stops the fleet: every child by
PID (SIGTERM, so workers drain; SIGKILL after a grace period), then the private Redis, leaving nothing running.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO

from gateway import server as gateway_server
from gpu_worker.serve.worker_cmd import cpu_list
from services import ports, private_redis
from services.redis_cluster import RedisCluster
from services.supervisor import REDIS_POLICY, ChildRestarts, exit_reason
from shared.settings import Settings, child_env, is_set, redacted_url

# worker flags passed through as they are: (flag, dest)
WORKER_FLAGS = [("--num-kv-blocks", "num_kv_blocks"), ("--kv-cache-memory", "kv_cache_memory"),
                ("--block-size", "block_size"), ("--max-num-seqs", "max_num_seqs"),
                ("--max-num-batched-tokens", "max_num_batched_tokens"), ("--max-model-len", "max_model_len"),
                ("--scheduling-policy", "scheduling_policy"), ("--dtype", "dtype"), ("--device", "device"),
                ("--drain-timeout", "drain_timeout"), ("--log-memory-usage", "log_memory_usage"),
                ("--simulate", "simulate"), ("--step-log", "step_log"),
                ("--tensor-parallel-size", "tensor_parallel_size")]
STDERR_TAIL_LINES = 5  # of a child's stderr, printed with the reason it exited


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, help="how many engine workers")
    p.add_argument("--model", help="HF directory, .gguf file or alias (default smollm2; env KVFLEET_MODEL)")
    p.add_argument("--host", default="127.0.0.1", help='address the gateway listens on')
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway's OpenAI-compatible API")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway replicas, on --port, --port+1, ... (each a process of its own, as Kubernetes "
                   "runs replicas behind a Service; put a load balancer in front, or spread clients over them)")
    p.add_argument("--redis-url", help="use this Redis instead of starting a private one (a Redis Cluster: "
                   "redis+cluster://HOST:PORT, any one of its nodes)")
    p.add_argument("--redis-cluster", type=int, metavar="MASTERS",
                   help="start a private Redis Cluster of this many masters instead of one private Redis (in "
                   "temporary directories, without persistence: to try or measure sharding)")
    p.add_argument("--redis-shards", type=int, help="shards of the fleet's keys (env KVFLEET_REDIS_SHARDS; default "
                   "1, or 4 per master with --redis-cluster)")
    p.add_argument("--data-dir", help="AOF directory of the private Redis; `kvfleet up` on the same one resumes "
                   "queued work (default ~/.local/share/kvfleet/redis-<port>)")
    p.add_argument("--redis-maxmemory", default=private_redis.DEFAULT_MAXMEMORY,
                   help="memory cap of the private Redis (noeviction: past it, new requests fail, none is dropped)")
    p.add_argument("--routing", help="gateway routing policy (free_blocks, prefix, least_loaded, round_robin)")
    p.add_argument("--api-key", action="append", dest="api_keys", help="require this bearer key (repeatable)")
    gateway_server.add_chat_arguments(p)
    p.add_argument("--metrics-port-base", type=int, help="worker i serves /livez, /readyz, /metrics on BASE+i")
    p.add_argument("--docker", action="store_true", help="start the fleet as Docker containers instead")
    for flag, dest in WORKER_FLAGS:
        p.add_argument(flag, dest=dest, help="passed to every worker (see `kvfleet worker --help`)")
    p.add_argument("--worker-cpus", type=cpu_list, metavar="LIST",
                   help="CPUs the CPU workers share out among themselves (e.g. 1-7), leaving the others to the "
                   "gateway, Redis and clients; default: every CPU this process may use")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help='turn off automatic prefix caching on every worker')
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="workers register without their warm-up (faster start; the first requests pay first-call "
                        "costs)")
    p.add_argument("--async-output", action="store_true",
                   help="every worker overlaps a step's output processing with the next forward (see `kvfleet "
                        "worker --help`)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the fleet")


def _child_env(settings: Settings) -> dict[str, str]:
    """Secrets travel in the environment, not argv (which `ps` shows to everyone)."""
    env = child_env(KVFLEET_REDIS_URL=settings.redis_url, PYTHONUNBUFFERED="1")
    if settings.api_keys:
        env["KVFLEET_API_KEYS"] = ",".join(settings.api_keys)
    return env


def fleet_commands(args: argparse.Namespace, settings: Settings, private: bool) -> list[tuple[str, list[str]]]:
    """(name, command) of each child: the gateways, then the workers (named by their worker id)."""
    cli = [sys.executable, "-m", "services.cli"]
    cmds = []
    for g in range(args.gateways):
        gateway = cli + ["gateway", "--host", args.host, "--port", str(args.port + g), "--model", settings.model]
        if args.routing:
            gateway += ["--routing", args.routing]
        gateway += gateway_server.chat_flags(args)
        cmds.append(("gateway" if g == 0 else f"gateway-{g}", gateway))
    shares = cpu_shares(args)
    for i in range(args.workers):
        wid = f"w{i}" if private else f"{os.uname().nodename}-{args.port}-w{i}"
        cmd = cli + ["worker", "--model", settings.model, "--worker-id", wid] + shares[i]
        for flag, dest in WORKER_FLAGS:
            if getattr(args, dest, None) is not None:
                cmd += [flag, str(getattr(args, dest))]
        if not args.enable_prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if not args.warmup:
            cmd.append("--no-warmup")
        if args.async_output:
            cmd.append("--async-output")
        if args.metrics_port_base is not None:
            cmd += ["--metrics-port", str(args.metrics_port_base + i)]
        cmds.append((wid, cmd))
    return cmds


def cpu_shares(args: argparse.Namespace) -> list[list[str]]:
    """Per worker, the flags that share this machine's CPUs out: with N CPU workers on C >= N cores, worker i
    gets its own C // N cores (--cpus) and as many threads; with more workers than cores, one thread each.
    Workers that compete for cores slow each other's every step (each waits for its slowest thread). Nothing
    for GPU or simulated workers, or one worker (it takes every core) unless --worker-cpus names the cores
    the workers may have."""
    n, given = args.workers, getattr(args, "worker_cpus", None)
    if (n <= 1 and not given) or getattr(args, "simulate", None) or (getattr(args, "device", None) or "cpu") != "cpu":
        return [[] for _ in range(n)]
    cores = given or sorted(os.sched_getaffinity(0))
    per = len(cores) // n
    if per == 0:
        return [["--threads", "1"] for _ in range(n)]
    return [["--cpus", ",".join(map(str, cores[i * per:(i + 1) * per])), "--threads", str(per)] for i in range(n)]


def _relay(pipe: IO[bytes], tail: deque[str]) -> None:
    """Copy a child's stderr to ours line by line, keeping its last lines. Reads to the end even when ours is
    gone (a closed pipe), so the child never blocks on a full one."""
    copy = True
    for line in iter(pipe.readline, b""):
        tail.append(line.decode(errors="replace"))
        try:
            if copy and hasattr(sys.stderr, "buffer"):
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
            elif copy:
                sys.stderr.write(tail[-1])
        except (OSError, ValueError):  # our stderr is closed: keep the tail, drop the copy
            copy = False
    pipe.close()


class Child:
    """One process of the fleet: started again with the same command (and worker id) when it exits. It learns
    how often it was restarted from KVFLEET_RESTARTS (a worker publishes it in its status)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], restarts: ChildRestarts):
        self.name, self.cmd, self.env, self.restarts = name, cmd, env, restarts
        self.proc: subprocess.Popen | None = None  # None while it waits for its restart, or stays down
        self.pid = 0
        self.tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._relay: threading.Thread | None = None

    def start(self) -> None:
        self.restarts.started()
        self.tail = deque(maxlen=STDERR_TAIL_LINES)  # a fresh one: the last run's reader may still be finishing
        env = dict(self.env, KVFLEET_RESTARTS=str(self.restarts.restarts))
        self.proc = subprocess.Popen(self.cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
        self.pid = self.proc.pid
        self._relay = threading.Thread(target=_relay, args=(self.proc.stderr, self.tail), daemon=True,
                                       name=f"stderr-{self.name}")
        self._relay.start()

    def poll(self) -> int | None:
        """Its return code if it exited since the last look (once its last stderr lines are in), else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        self.proc = None
        self.join()
        return code

    def join(self) -> None:
        if self._relay is not None:
            self._relay.join(timeout=1.0)


def _wait_ready(url: str, children: list[Child], timeout_s: float, stopping: list) -> str | None:
    """None once the gateway answers `url`; else why not (a child exited, or the time ran out)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping:
        for c in children:
            if (code := c.poll()) is not None:
                return f"{c.name} (pid {c.pid}) {exit_reason(code, c.tail)}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return "stopped" if stopping else f"no answer from {url} within --startup-timeout {timeout_s:g}s"


def _note_exit(c: Child, code: int) -> None:
    reason = exit_reason(code, c.tail)
    delay = c.restarts.exited()
    if delay is not None:
        say(f"{c.name} (pid {c.pid}) {reason}; starting it again in {delay:g}s with the same command "
            "(the rest of the fleet keeps serving)", err=True)
        return
    p = c.restarts.policy
    say(f"{c.name} (pid {c.pid}) {reason}.\nkvfleet: {c.name} is in a crash loop: started again "
        f"{c.restarts.recent_restarts()} times within {p.window_s:g}s, it exited each time ({c.restarts.exits} "
        "exits in all). It stays down; the rest of the fleet keeps running. Find the cause in its log above, fix "
        "it, then restart the fleet (Ctrl-C, then `kvfleet up` again).", err=True)


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


def say(message: str, err: bool = False) -> None:
    print(f"kvfleet: {message}", file=sys.stderr if err else sys.stdout, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.docker:
        from services.docker_fleet import start_docker_fleet

        return start_docker_fleet(args)
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    if args.gateways < 1:
        raise SystemExit(f"--gateways must be >= 1, got {args.gateways}")
    if taken := [args.port + g for g in range(args.gateways) if not ports.bindable(args.port + g, args.host)]:
        which = ("" if args.gateways == 1 else
                 f" (gateway i listens on --port + i: {args.port}-{args.port + args.gateways - 1})")
        raise SystemExit(f"kvfleet up: port {', '.join(map(str, taken))} on {args.host} is in use{which}; is a fleet "
                         "already running there? Stop it, or choose another --port")
    if args.redis_cluster is not None and (args.redis_cluster < 1 or args.redis_url is not None):
        raise SystemExit("--redis-cluster takes a number of masters >= 1, and no --redis-url")
    shards = args.redis_shards or (4 * args.redis_cluster if args.redis_cluster else None)
    if shards is not None and shards < 1:
        raise SystemExit(f"--redis-shards must be >= 1, got {shards}")
    settings = Settings.from_env(redis_url=args.redis_url, model=args.model, api_keys=args.api_keys,
                                 redis_shards=shards, **gateway_server.chat_overrides(args))
    try:
        gateway_server.check_chat_settings(settings)
    except ValueError as e:
        raise SystemExit(f"kvfleet up: {e}") from None
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    redis_server, redis_cluster = None, None
    children: list[Child] = []
    code = 0
    try:
        if args.redis_cluster:
            try:
                redis_cluster = RedisCluster(args.redis_cluster, password=secrets.token_urlsafe(24)).start()
            except (RuntimeError, OSError) as e:
                say(f"cannot start the private Redis Cluster: {e}", err=True)
                return 1
            settings = settings.with_overrides(redis_url=redis_cluster.url)
            say(f"private Redis Cluster: {args.redis_cluster} masters on 127.0.0.1 ports "
                f"{', '.join(map(str, redis_cluster.ports))} (pids {', '.join(map(str, redis_cluster.pids))}), "
                f"no persistence; the fleet's keys in {settings.redis_shards} shards")
        elif args.redis_url is None and not is_set("redis_url"):
            data_dir = args.data_dir or private_redis.default_data_dir(args.port)
            try:
                redis_server = private_redis.start(data_dir, args.redis_maxmemory)
            except (RuntimeError, OSError) as e:
                say(f"cannot start the private Redis: {e}", err=True)
                return 1
            settings = settings.with_overrides(redis_url=redis_server.url)
            say(private_redis.describe(redis_server))
        env = _child_env(settings)
        env["KVFLEET_REDIS_SHARDS"] = str(settings.redis_shards)
        for name, cmd in fleet_commands(args, settings, private=redis_server is not None or redis_cluster is not None):
            children.append(Child(name, cmd, env, ChildRestarts()))
            children[-1].start()
        gateways, workers = children[:args.gateways], children[args.gateways:]
        say(f"starting {'gateway' if len(gateways) == 1 else f'{len(gateways)} gateways'} "
            f"(pid {', '.join(str(c.pid) for c in gateways)}) and {args.workers} worker(s) "
            f"({', '.join(str(c.pid) for c in workers)}) serving {settings.model}; Redis "
            f"{redacted_url(settings.redis_url)}")
        base = f"http://{args.host}:{args.port}"
        why = None
        for g in range(args.gateways):
            why = why or _wait_ready(f"http://{args.host}:{args.port + g}/health", children, args.startup_timeout,
                                     stopping)
        if why is not None:
            if not stopping:  # a child that dies while the fleet starts has a configuration to fix
                say(f"the fleet did not come up: {why}", err=True)
                code = 1
            return code
        more = "".join(f", http://{args.host}:{args.port + g}/v1" for g in range(1, args.gateways))
        say(f"ready. OpenAI-compatible API at {base}/v1{more}  (model {settings.model!r}; "
            f"try: curl {base}/v1/models). Ctrl-C stops the fleet.")
        redis_record = ChildRestarts(REDIS_POLICY)
        while not stopping:
            for c in children:
                if (exit_code := c.poll()) is not None:
                    _note_exit(c, exit_code)
                elif c.restarts.due():
                    c.start()
                    say(f"{c.name} started again as pid {c.pid} (restart {c.restarts.restarts})")
            if redis_server is not None and not private_redis.keep(redis_server, redis_record, say):
                return 1
            time.sleep(0.2)
        return code
    finally:
        say("stopping")
        drain = float(args.drain_timeout) if args.drain_timeout is not None else 30.0
        stop_all([c.proc for c in children if c.proc is not None], grace_s=drain + 5)
        for c in children:
            c.join()
        if redis_server is not None:
            private_redis.stop(redis_server)
        if redis_cluster is not None:
            redis_cluster.stop()
        say("stopped")
