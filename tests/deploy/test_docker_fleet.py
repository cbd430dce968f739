"""services/docker_fleet.py: the containers of `kvfleet up --docker`, and the message when no engine runs."""

from __future__ import annotations

import argparse

import pytest
from deploy_checks import check_command, flag_values

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
    redis, gateway, *workers = fleet_container_specs(workers=2, port=8123, api_keys=["sk-a", "sk-b"])
    assert redis.image == REDIS_IMAGE and redis.command[:3] == ["redis-server", "--appendonly", "yes"]
    assert redis.volumes == {"kvfleet-redis-data": {"bind": "/data", "mode": "rw"}}
    assert redis.ports == {"6379/tcp": ("127.0.0.1", None)}
    url = "redis://kvfleet-redis:6379/0"
    assert gateway.image == GATEWAY_IMAGE and check_command(gateway.command) == "gateway"
    assert flag_values(gateway.command)["--redis-url"] == url
    assert gateway.ports == {"8000/tcp": ("127.0.0.1", 8123)}
    assert gateway.environment["KVFLEET_API_KEYS"] == "sk-a,sk-b"
    assert {s.network for s in (redis, gateway, *workers)} == {"kvfleet-net"}
    assert [w.name for w in workers] == ["kvfleet-worker-0", "kvfleet-worker-1"]
    for w in workers:
        assert w.image == WORKER_IMAGES["cpu"] and check_command(w.command) == "worker"
        flags = flag_values(w.command)
        assert (flags["--redis-url"], flags["--device"], flags["--model"]) == (url, "cpu", "smollm2")
        assert w.environment["KVFLEET_METRICS_HOST"] == "0.0.0.0" and w.gpu_ids == ()
        assert w.stop_timeout > float(flags["--drain-timeout"])
        assert "KVFLEET_API_KEYS" not in w.environment
    kwargs = workers[0].run_kwargs()
    assert kwargs["stop_signal"] == "SIGTERM" and kwargs["detach"] is True and "device_requests" not in kwargs


def test_up_docker_flags_reach_the_containers():
    """`kvfleet up --docker ...` parsed as the CLI parses it: the keys reach the gateway (only), the worker
    flags (strings in the launcher's parser) the workers."""
    args = build_parser().parse_args(["up", "--docker", "--workers", "3", "--port", "8124", "--api-key", "sk-1",
                                      "--api-key", "sk-2", "--drain-timeout", "12.5", "--num-kv-blocks", "256",
                                      "--routing", "prefix"])
    redis, gateway, *workers = specs_from_args(args)
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


def test_gpu_fleet_spreads_workers_over_gpus_and_external_redis():
    specs = fleet_container_specs(workers=3, device="cuda", gpu_ids=("0", "1"), redis_url="redis://cache:6379/2",
                                  num_kv_blocks=4096, dtype="bfloat16")
    assert [s.name for s in specs] == ["kvfleet-gateway", "kvfleet-worker-0", "kvfleet-worker-1",
                                       "kvfleet-worker-2"]
    workers = specs[1:]
    assert [w.gpu_ids for w in workers] == [("0",), ("1",), ("0",)]
    for w in workers:
        assert w.image == WORKER_IMAGES["cuda"] and check_command(w.command) == "worker"
        flags = flag_values(w.command)
        assert (flags["--device"], flags["--num-kv-blocks"], flags["--dtype"]) == ("cuda", "4096", "bfloat16")
        assert w.environment["KVFLEET_REDIS_URL"] == "redis://cache:6379/2"
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
