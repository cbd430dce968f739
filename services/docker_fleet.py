"""`kvfleet up --docker`: the same fleet as `kvfleet up` (Redis, a gateway, N workers), as Docker containers.

`fleet_container_specs` is a pure function from the fleet's shape to the containers it takes (image,
command, environment, ports, network); `start_docker_fleet` creates them through the `docker` package, in
the foreground: Ctrl-C or SIGTERM stops them (workers drain first) and removes them. The images are the
ones docker/ builds (`docker-compose build`, or `docker build -f docker/Dockerfile.<x> ...`).

The Redis it starts (unless --redis-url) keeps an AOF in a named volume, caps its memory with noeviction, and
has a random password, new on each start (`secrets.token_urlsafe`). The password travels in environments only,
never in a command line (`docker inspect`'s Args and `ps` on the host show those): Redis gets it as REDISCLI_AUTH
(its shell `printf`s it into a config file, as docker-compose.yml does, and `redis-cli` in the container
authenticates with it), the gateway and workers in KVFLEET_REDIS_URL, which is also how a given --redis-url
reaches them.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import docker.types  # binds `docker` too (docker.from_env)
from docker.errors import DockerException, ImageNotFound, NotFound
from docker.utils import kwargs_from_env

from gateway.server import chat_flags
from services.private_redis import DEFAULT_MAXMEMORY
from shared.settings import redacted_url

VERSION_TAG = "0.1.0"
GATEWAY_IMAGE = f"kvfleet-gateway:{VERSION_TAG}"
WORKER_IMAGES = {"cpu": f"kvfleet-worker-cpu:{VERSION_TAG}", "cuda": f"kvfleet-worker-gpu:{VERSION_TAG}"}
DOCKERFILES = {GATEWAY_IMAGE: "docker/Dockerfile.gateway", WORKER_IMAGES["cpu"]: "docker/Dockerfile.worker-cpu",
               WORKER_IMAGES["cuda"]: "docker/Dockerfile.worker-gpu"}
REDIS_IMAGE = "redis:7.2-alpine"
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
FLEET_LABEL = "io.kvfleet.fleet"
GATEWAY_PORT = 8000
METRICS_PORT = 9100
MODEL_MOUNT = "/models"
# Runs as root (the image's entrypoint passes other commands through), writes the password's config file with
# the shell builtin printf (nothing in argv), then execs the entrypoint, which drops to the `redis` user.
REDIS_START = ("printf 'requirepass \"%s\"\\n' \"$REDISCLI_AUTH\" > /tmp/auth.conf && chmod 644 /tmp/auth.conf"
               " && exec docker-entrypoint.sh redis-server /tmp/auth.conf \"$@\"")


@dataclass(frozen=True)
class ContainerSpec:
    name: str
    image: str
    command: list[str]
    environment: dict[str, str]
    network: str
    # container port ("8000/tcp") -> (host ip, host port or None for any free port)
    ports: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    # host path or named volume -> {"bind": path in the container, "mode": "ro" | "rw"}
    volumes: dict[str, dict[str, str]] = field(default_factory=dict)
    gpu_ids: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    stop_timeout: int = 10  # seconds between SIGTERM and SIGKILL

    def run_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `docker.DockerClient().containers.run`."""
        kwargs: dict[str, Any] = dict(
            image=self.image, command=self.command, name=self.name, environment=self.environment,
            network=self.network, labels=self.labels, stop_signal="SIGTERM", detach=True,
            ports=dict(self.ports), volumes=self.volumes,
        )
        if self.gpu_ids:
            kwargs["device_requests"] = [docker.types.DeviceRequest(
                driver="nvidia", device_ids=list(self.gpu_ids), capabilities=[["gpu"]])]
        return kwargs


def fleet_container_specs(*, workers: int = 2, model: str = "smollm2", port: int = GATEWAY_PORT,
                          device: str = "cpu", redis_url: str | None = None, routing: str = "free_blocks",
                          api_keys: Sequence[str] = (), drain_timeout: int = 30, dtype: str | None = None,
                          num_kv_blocks: int | None = None, kv_cache_memory: str | None = None,
                          gpu_ids: Sequence[str] = ("0",), fleet: str = "kvfleet",
                          redis_maxmemory: str = DEFAULT_MAXMEMORY,
                          redis_password: str | None = None, chat_flags: Sequence[str] = ()) -> list[ContainerSpec]:
    """The containers of one fleet, in start order: Redis (unless `redis_url` names one), gateway, workers.
    Worker i of a cuda fleet gets GPU gpu_ids[i % len(gpu_ids)]. The Redis started here gets `redis_password`,
    or a random one when None. `chat_flags`: the gateway's chat flags (gateway.server.chat_flags); a
    --chat-template file is mounted into the gateway."""
    if workers < 1:
        raise ValueError(f"a fleet needs at least one worker; got workers={workers}")
    if device not in WORKER_IMAGES:
        raise ValueError(f"device must be one of {sorted(WORKER_IMAGES)}; got {device!r}")
    if redis_url is not None and any(h in redis_url for h in ("@localhost", "//localhost", "127.0.0.1")):
        raise ValueError(f"--redis-url {redis_url!r} points at the loopback address, which inside a container is"
                         " the container itself: give an address the containers can reach, or leave it out"
                         " to start Redis in a container")
    network = f"{fleet}-net"
    labels = {FLEET_LABEL: fleet}
    specs: list[ContainerSpec] = []
    if redis_url is None:
        password = redis_password or secrets.token_urlsafe(32)
        redis_url = f"redis://:{quote(password, safe='')}@{fleet}-redis:6379/0"
        specs.append(ContainerSpec(
            name=f"{fleet}-redis", image=REDIS_IMAGE, network=network, labels=labels,
            command=["sh", "-c", REDIS_START, "redis", "--appendonly", "yes", "--appendfsync", "everysec",
                     "--dir", "/data", "--maxmemory", redis_maxmemory, "--maxmemory-policy", "noeviction"],
            environment={"REDISCLI_AUTH": password}, ports={"6379/tcp": ("127.0.0.1", None)},
            volumes={f"{fleet}-redis-data": {"bind": "/data", "mode": "rw"}}))

    # A local model (directory or .gguf) is mounted at the same path in the gateway (tokenizer) and workers.
    volumes: dict[str, dict[str, str]] = {}
    model_arg = model
    local = Path(model).expanduser()
    if local.exists():
        model_arg = f"{MODEL_MOUNT}/{local.name}"
        volumes[str(local.resolve())] = {"bind": model_arg, "mode": "ro"}

    gateway_volumes, chat = dict(volumes), list(chat_flags)
    if "--chat-template" in chat:  # a template file on this machine: mounted where the gateway reads it
        k = chat.index("--chat-template") + 1
        template = Path(chat[k]).expanduser()
        if "{" not in chat[k] and template.is_file():
            chat[k] = f"/templates/{template.name}"
            gateway_volumes[str(template.resolve())] = {"bind": chat[k], "mode": "ro"}

    env = {"KVFLEET_REDIS_URL": redis_url, "HF_HUB_OFFLINE": "1"}  # the URL, password included: never argv
    gateway_env = dict(env, OTEL_SERVICE_NAME="kvfleet-gateway")
    if api_keys:
        gateway_env["KVFLEET_API_KEYS"] = ",".join(api_keys)
    specs.append(ContainerSpec(
        name=f"{fleet}-gateway", image=GATEWAY_IMAGE, network=network, labels=labels, environment=gateway_env,
        command=["kvfleet", "gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--routing", routing, *chat],
        ports={f"{GATEWAY_PORT}/tcp": ("127.0.0.1", port)}, volumes=gateway_volumes, stop_timeout=60))

    for i in range(workers):
        command = ["kvfleet", "worker", "--model", model_arg,
                   "--worker-id", f"{fleet}-worker-{i}", "--metrics-port", str(METRICS_PORT),
                   "--drain-timeout", str(drain_timeout), "--device", device]
        if dtype:
            command += ["--dtype", dtype]
        if num_kv_blocks is not None:
            command += ["--num-kv-blocks", str(num_kv_blocks)]
        elif kv_cache_memory is not None:
            command += ["--kv-cache-memory", str(kv_cache_memory)]
        specs.append(ContainerSpec(
            name=f"{fleet}-worker-{i}", image=WORKER_IMAGES[device], network=network, labels=labels,
            command=command, volumes=volumes,
            environment=dict(env, OTEL_SERVICE_NAME="kvfleet-worker", KVFLEET_METRICS_HOST="0.0.0.0"),
            gpu_ids=(str(gpu_ids[i % len(gpu_ids)]),) if device == "cuda" else (),
            stop_timeout=drain_timeout + 15))
    return specs


def docker_host() -> str:
    """Where the `docker` package looks for the engine (DOCKER_HOST, else the default socket)."""
    return kwargs_from_env().get("base_url", DEFAULT_DOCKER_HOST)


def specs_from_args(args: argparse.Namespace) -> list[ContainerSpec]:
    """The containers for `kvfleet up --docker ...`: the flags as services.launcher parses them (the worker
    flags it passes through arrive as strings)."""
    num_kv_blocks = getattr(args, "num_kv_blocks", None)
    drain_timeout = getattr(args, "drain_timeout", None)
    return fleet_container_specs(
        workers=getattr(args, "workers", 2), model=getattr(args, "model", None) or "smollm2",
        port=getattr(args, "port", GATEWAY_PORT), device=getattr(args, "device", None) or "cpu",
        redis_url=getattr(args, "redis_url", None), routing=getattr(args, "routing", None) or "free_blocks",
        api_keys=getattr(args, "api_keys", None) or (),
        drain_timeout=30 if drain_timeout is None else round(float(drain_timeout)),
        dtype=getattr(args, "dtype", None), num_kv_blocks=None if num_kv_blocks is None else int(num_kv_blocks),
        kv_cache_memory=getattr(args, "kv_cache_memory", None), gpu_ids=getattr(args, "gpu_ids", None) or ("0",),
        redis_maxmemory=getattr(args, "redis_maxmemory", None) or DEFAULT_MAXMEMORY,
        chat_flags=chat_flags(args) if hasattr(args, "chat_template") else ())


def start_docker_fleet(args: argparse.Namespace) -> int:
    """Run the fleet of `kvfleet up --docker` until Ctrl-C / SIGTERM; returns the exit status."""
    specs = specs_from_args(args)
    try:
        client = docker.from_env()
        client.ping()
    except DockerException as e:
        print(f"kvfleet: no Docker engine reachable at {docker_host()} ({e}).\n"
              "Start Docker (or point DOCKER_HOST at a running engine), or run `kvfleet up` without --docker"
              " to start the fleet as local processes.", file=sys.stderr)
        return 1

    for image in sorted({s.image for s in specs} - {REDIS_IMAGE}):
        try:
            client.images.get(image)
        except ImageNotFound:
            print(f"kvfleet: image {image} not found: build it first with "
                  f"`docker build -f {DOCKERFILES[image]} -t {image} .` (or `docker-compose build`).",
                  file=sys.stderr)
            return 1

    network = specs[0].network
    if not client.networks.list(names=[network]):
        client.networks.create(network, driver="bridge", labels=specs[0].labels)
    started = []
    try:
        for spec in specs:
            try:
                stale = client.containers.get(spec.name)
            except NotFound:
                stale = None
            if stale is not None:
                if stale.status == "running":
                    print(f"kvfleet: container {spec.name} is already running: stop that fleet first"
                          f" (`docker rm -f {spec.name}`).", file=sys.stderr)
                    return 1
                stale.remove(force=True)
            try:
                started.append((spec, client.containers.run(**spec.run_kwargs())))
            except DockerException as e:
                print(f"kvfleet: could not start {spec.name}: {e}", file=sys.stderr)
                return 1
        gateway = next(s for s in specs if s.image == GATEWAY_IMAGE)
        redis = next((s for s in specs if s.image == REDIS_IMAGE), None)
        where = (f"`docker exec -it {redis.name} redis-cli` (it authenticates with the REDISCLI_AUTH of its"
                 " environment)" if redis is not None else "given with --redis-url")
        print(f"kvfleet: fleet up in Docker ({len(specs)} containers on network {network}); API at "
              f"http://127.0.0.1:{gateway.ports[f'{GATEWAY_PORT}/tcp'][1]}/v1 (workers answer once their model"
              f" is loaded); Redis {redacted_url(gateway.environment['KVFLEET_REDIS_URL'])}: {where}."
              " Ctrl-C stops it.", flush=True)
        if getattr(args, "detach", False):
            started = []  # leave them running
            return 0
        return _wait(started)
    finally:
        for spec, container in reversed(started):
            try:
                container.stop(timeout=spec.stop_timeout)
                container.remove()
            except DockerException as e:
                print(f"kvfleet: could not remove {spec.name}: {e}", file=sys.stderr)


def _wait(started: list) -> int:
    """Block until Ctrl-C / SIGTERM (0) or until a container exits on its own (1)."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while True:
            time.sleep(1.0)
            for spec, container in started:
                container.reload()
                if container.status not in ("created", "running", "restarting"):
                    print(f"kvfleet: {spec.name} exited ({container.status}); stopping the fleet. The end of"
                          " its log:", file=sys.stderr)
                    print(container.logs(tail=20).decode(errors="replace"), file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        print("kvfleet: stopping (workers drain first)...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
