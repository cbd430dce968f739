"""services/docker_fleet.py: the containers of `kvfleet up --docker`, and the message when no engine runs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from deploy_checks import check_command, flag_values, run_redis_command
from docker.errors import NotFound
from redis import AuthenticationError, Redis

from services.cli import build_parser
from services.docker_fleet import (
    GATEWAY_IMAGE,
    REDIS_IMAGE,
    WORKER_IMAGES,
    fleet_container_specs,
    specs_from_args,
    start_docker_fleet,
)

pytestmark = pytest.mark.deploy


def test_default_fleet_specs():
    redis, gateway, *workers = fleet_container_specs(workers=2, port=8123, api_keys=["sk-a", "sk-b"],
                                                     redis_password="pw-1")
    assert redis.image == REDIS_IMAGE and redis.command[:2] == ["sh", "-c"]
    flags = flag_values(redis.command)
    assert (flags["--appendonly"], flags["--appendfsync"], flags["--dir"]) == ("yes", "everysec", "/data")
    assert (flags["--maxmemory"], flags["--maxmemory-policy"]) == ("1gb", "noeviction")
    assert redis.volumes == {"kvfleet-redis-data": {"bind": "/data", "mode": "rw"}}
    assert redis.ports == {"6379/tcp": ("127.0.0.1", None)}
    url = "redis://:pw-1@kvfleet-redis:6379/0"
    assert gateway.image == GATEWAY_IMAGE and check_command(gateway.command) == "gateway"
    assert gateway.environment["KVFLEET_REDIS_URL"] == url
    assert gateway.ports == {"8000/tcp": ("127.0.0.1", 8123)}
    assert gateway.environment["KVFLEET_API_KEYS"] == "sk-a,sk-b"
    assert {s.network for s in (redis, gateway, *workers)} == {"kvfleet-net"}
    assert [w.name for w in workers] == ["kvfleet-worker-0", "kvfleet-worker-1"]
    for w in workers:
        assert w.image == WORKER_IMAGES["cpu"] and check_command(w.command) == "worker"
        flags = flag_values(w.command)
        assert (flags["--device"], flags["--model"]) == ("cpu", "smollm2")
        assert w.environment["KVFLEET_REDIS_URL"] == url
        assert w.environment["KVFLEET_METRICS_HOST"] == "0.0.0.0" and w.gpu_ids == ()
        assert w.stop_timeout > float(flags["--drain-timeout"])
        assert "KVFLEET_API_KEYS" not in w.environment
    kwargs = workers[0].run_kwargs()
    assert kwargs["stop_signal"] == "SIGTERM" and kwargs["detach"] is True and "device_requests" not in kwargs


def test_fleet_redis_has_a_random_password_only_in_environments():
    """Each fleet's Redis gets its own password; Redis and every container that talks to it have it in their
    environment, and no container's command line (`docker inspect`, `ps` on the host) shows it."""
    passwords = []
    for _ in range(2):
        specs = fleet_container_specs(workers=2)
        redis, gateway, *workers = specs
        password = redis.environment["REDISCLI_AUTH"]
        assert len(password) >= 32 and re.fullmatch(r"[A-Za-z0-9_-]+", password), "URL- and config-file-safe"
        for spec in (gateway, *workers):
            url = urlsplit(spec.environment["KVFLEET_REDIS_URL"])
            assert (url.password, url.hostname, url.port) == (password, "kvfleet-redis", 6379), spec.name
        for spec in specs:
            assert not any(password in arg for arg in spec.command), f"{spec.name}'s command shows the password"
            assert "--redis-url" not in spec.command and "--requirepass" not in spec.command
        passwords.append(password)
    assert passwords[0] != passwords[1]


def test_fleet_redis_command_really_starts_an_authenticated_redis(tmp_path):
    """The Redis container's command, run by a real shell and redis-server: it requires the password of
    REDISCLI_AUTH, has AOF and maxmemory/noeviction, and its command line shows no password."""
    spec = fleet_container_specs(redis_maxmemory="512mb", redis_password="pw-config-file")[0]
    assert spec.command[:2] == ["sh", "-c"] and "exec docker-entrypoint.sh redis-server" in spec.command[2], \
        "the image's entrypoint drops root before Redis runs"
    with run_redis_command(spec.command, spec.environment, "pw-config-file", tmp_path,
                           {"/tmp": "tmp", "/data": "data"}) as (pid, client):
        with pytest.raises(AuthenticationError):
            Redis(port=client.connection_pool.connection_kwargs["port"], socket_timeout=5).ping()
        config = client.config_get("*")
        assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")
        assert (config["maxmemory"], config["maxmemory-policy"]) == (str(512 * 1024**2), "noeviction")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"redis-server" in cmdline and b"pw-config-file" not in cmdline


def test_up_docker_flags_reach_the_containers():
    """`kvfleet up --docker ...` parsed as the CLI parses it: the keys reach the gateway (only), the worker
    flags (strings in the launcher's parser) the workers."""
    args = build_parser().parse_args(["up", "--docker", "--workers", "3", "--port", "8124", "--api-key", "sk-1",
                                      "--api-key", "sk-2", "--drain-timeout", "12.5", "--num-kv-blocks", "256",
                                      "--routing", "prefix", "--redis-maxmemory", "2gb"])
    redis, gateway, *workers = specs_from_args(args)
    assert flag_values(redis.command)["--maxmemory"] == "2gb"
    assert gateway.environment["KVFLEET_API_KEYS"] == "sk-1,sk-2"
    assert "sk-1" not in " ".join(gateway.command)  # secrets travel in the environment, not argv
    assert flag_values(gateway.command)["--routing"] == "prefix"
    assert gateway.ports == {"8000/tcp": ("127.0.0.1", 8124)}
    assert len(workers) == 3
    for w in workers:
        assert "KVFLEET_API_KEYS" not in w.environment
        flags = flag_values(w.command)
        assert (flags["--num-kv-blocks"], flags["--drain-timeout"]) == ("256", "12")
        assert w.stop_timeout > 12
    open_fleet = specs_from_args(build_parser().parse_args(["up", "--docker"]))
    assert "KVFLEET_API_KEYS" not in open_fleet[1].environment


def test_up_docker_chat_flags_reach_the_gateway_and_a_template_file_is_mounted(tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(["up", "--docker", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--chat-template", str(template)])
    _redis, gateway, *workers = specs_from_args(args)
    flags = flag_values(gateway.command)
    assert "--enable-auto-tool-choice" in gateway.command and flags["--tool-call-parser"] == "hermes"
    assert flags["--chat-template"] == "/templates/mine.jinja"
    assert gateway.volumes[str(template.resolve())] == {"bind": "/templates/mine.jinja", "mode": "ro"}
    assert all("--chat-template" not in w.command for w in workers)
    shipped = specs_from_args(build_parser().parse_args(["up", "--docker", "--chat-template", "chatml-tools"]))
    assert flag_values(shipped[1].command)["--chat-template"] == "chatml-tools" and not shipped[1].volumes


def test_gpu_fleet_spreads_workers_over_gpus_and_external_redis():
    external = "redis://:ext-secret@cache:6379/2"
    specs = fleet_container_specs(workers=3, device="cuda", gpu_ids=("0", "1"), redis_url=external,
                                  num_kv_blocks=4096, dtype="bfloat16")
    assert [s.name for s in specs] == ["kvfleet-gateway", "kvfleet-worker-0", "kvfleet-worker-1",
                                       "kvfleet-worker-2"]
    workers = specs[1:]
    assert [w.gpu_ids for w in workers] == [("0",), ("1",), ("0",)]
    for w in workers:
        assert w.image == WORKER_IMAGES["cuda"] and check_command(w.command) == "worker"
        flags = flag_values(w.command)
        assert (flags["--device"], flags["--num-kv-blocks"], flags["--dtype"]) == ("cuda", "4096", "bfloat16")
        assert w.environment["KVFLEET_REDIS_URL"] == external
    assert specs[0].environment["KVFLEET_REDIS_URL"] == external
    assert not any("ext-secret" in arg for s in specs for arg in s.command)
    (request,) = workers[0].run_kwargs()["device_requests"]
    assert request["Driver"] == "nvidia" and request["DeviceIDs"] == ["0"] and request["Capabilities"] == [["gpu"]]


def test_local_model_is_mounted_read_only(tmp_path):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    _, gateway, worker = fleet_container_specs(workers=1, model=str(model))
    assert flag_values(worker.command)["--model"] == "/models/tiny.gguf"
    assert worker.volumes == gateway.volumes == {str(model): {"bind": "/models/tiny.gguf", "mode": "ro"}}


def test_bad_shapes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="loopback"):
        fleet_container_specs(redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="at least one worker"):
        fleet_container_specs(workers=0)
    with pytest.raises(ValueError, match="device must be one of"):
        fleet_container_specs(device="tpu")


def test_no_docker_engine_says_so(tmp_path, monkeypatch, capsys):
    socket = tmp_path / "docker.sock"  # nothing listens here
    monkeypatch.setenv("DOCKER_HOST", f"unix://{socket}")
    args = argparse.Namespace(workers=2, model="smollm2", port=8000, redis_url=None, docker=True)
    assert start_docker_fleet(args) == 1
    err = capsys.readouterr().err
    assert f"no Docker engine reachable at unix://{socket}" in err
    assert "without --docker" in err


class _FakeEngine:
    """Just enough of `docker.DockerClient` for start_docker_fleet: records what it is asked to run."""

    def __init__(self):
        self.runs: list[dict] = []
        self.images = SimpleNamespace(get=lambda image: None)
        self.networks = SimpleNamespace(list=lambda names: [], create=lambda *a, **k: None)
        self.containers = SimpleNamespace(get=self._missing, run=lambda **kwargs: self.runs.append(kwargs))

    def ping(self):
        return True

    @staticmethod
    def _missing(name):
        raise NotFound(f"no container {name}")


def test_up_docker_prints_no_password(monkeypatch, capsys):
    engine = _FakeEngine()
    monkeypatch.setattr("services.docker_fleet.docker.from_env", lambda: engine)
    args = build_parser().parse_args(["up", "--docker"])
    args.detach = True  # returns once the containers run, instead of waiting for Ctrl-C
    assert start_docker_fleet(args) == 0
    password = engine.runs[0]["environment"]["REDISCLI_AUTH"]
    assert [r["name"] for r in engine.runs] == ["kvfleet-redis", "kvfleet-gateway", "kvfleet-worker-0"]
    assert all(password in r["environment"].get("KVFLEET_REDIS_URL", password) for r in engine.runs)
    out = capsys.readouterr().out
    assert "redis://:***@kvfleet-redis:6379/0" in out and "docker exec -it kvfleet-redis redis-cli" in out
    assert password not in out
