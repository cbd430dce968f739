"""docker-compose.yml: valid for Debian's docker-compose v1 (`config -q`), and true to kvfleet's processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from deploy_checks import REPO, check_command, flag_values

pytestmark = pytest.mark.deploy

PROFILES = {"cpu": ("worker-cpu-0", "worker-cpu-1"), "gpu": ("worker-gpu-0", "worker-gpu-1"),
            "gpu-tp": ("worker-gpu-tp",)}
PASSWORD = "0123456789abcdef-test"  # what a user puts into .env as KVFLEET_REDIS_PASSWORD
SETTINGS = ("KVFLEET_REDIS_PASSWORD", "KVFLEET_GATEWAY_BIND", "KVFLEET_API_KEYS", "KVFLEET_METRICS_OPEN",
            "KVFLEET_REDIS_MAXMEMORY")


NO_ENV_FILE = Path(tempfile.mkdtemp(prefix="kvfleet-compose-")) / "empty.env"  # not the developer's .env
NO_ENV_FILE.touch()


def run_compose(*args: str, **env: str) -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose (Debian's v1) is missing: `make setup` installs it"
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS} | {"KVFLEET_REDIS_PASSWORD": PASSWORD} | env
    return subprocess.run([exe, "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
                           "--env-file", str(NO_ENV_FILE), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=clean)


def compose(*args: str, **env: str) -> str:
    proc = run_compose(*args, **env)
    assert proc.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def published(port: str | dict) -> tuple[str, int, int]:
    """(host ip, published, target) of a port as docker-compose v1 prints it (short or long syntax)."""
    if isinstance(port, dict):
        return port.get("host_ip", "0.0.0.0"), int(port["published"]), int(port["target"])
    *ip, host, target = port.split("/")[0].split(":")
    return (ip[0] if ip else "0.0.0.0"), int(host), int(target)


def volume(entry: str) -> tuple[str, str, str]:
    """(source, target, mode) of a short-syntax volume as docker-compose v1 prints it."""
    source, target, mode = entry.split(":")
    return source, target, mode


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(compose(*(a for p in PROFILES for a in ("--profile", p)), "config"))


def test_config_is_valid():
    assert compose("config", "-q") == ""
    for profile in PROFILES:
        assert compose("--profile", profile, "config", "-q") == ""


def test_profiles_select_their_workers(config):
    # docker-compose v1 `config` lists every service with its `profiles`; `up` starts those without a
    # profile plus the ones of each --profile given.
    services = config["services"]
    always = {name for name, svc in services.items() if not svc.get("profiles")}
    assert always == {"redis", "gateway", "celery", "otel-collector", "jaeger", "prometheus", "grafana"}
    for profile, workers in PROFILES.items():
        assert {name for name, svc in services.items() if svc.get("profiles") == [profile]} == set(workers)


def test_services_run_real_entry_points(config):
    services = config["services"]
    assert check_command(services["gateway"]["command"]) == "gateway"
    assert check_command(services["celery"]["command"]) == "celery"
    ids = set()
    for profile, workers in PROFILES.items():
        for name in workers:
            svc = services[name]
            assert check_command(svc["command"]) == "worker"
            flags = flag_values(svc["command"])
            assert flags["--device"] == ("cuda" if profile.startswith("gpu") else "cpu")
            assert "--redis-url" not in flags, "a Redis URL in argv would show its password to `ps`"
            assert svc["environment"]["KVFLEET_REDIS_URL"] == f"redis://:{PASSWORD}@redis:6379/0"
            assert flags["--model"] == "smollm2"  # ${KVFLEET_MODEL:-smollm2}
            ids.add(flags["--worker-id"])
            # docker stops it with SIGTERM, then SIGKILL after stop_grace_period: longer than the drain.
            grace = int(svc["stop_grace_period"].rstrip("s"))
            assert grace > float(flags["--drain-timeout"]) + 5
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
            assert "build" in svc, "each service that uses a kvfleet image builds it (no pull attempted)"
    assert len(ids) == 5
    assert published(services["gateway"]["ports"][0])[2] == int(flag_values(services["gateway"]["command"])["--port"])
    for name in ("gateway", "celery"):
        assert "--redis-url" not in services[name]["command"]
        assert services[name]["environment"]["KVFLEET_REDIS_URL"] == f"redis://:{PASSWORD}@redis:6379/0"


def test_gpu_workers_reserve_one_gpu_each(config):
    devices = []
    for name in PROFILES["gpu"]:
        (dev,) = config["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        devices += dev["device_ids"]
    assert devices == ["0", "1"]
    for name in PROFILES["cpu"]:
        assert "deploy" not in config["services"][name]


def test_tensor_parallel_worker_reserves_a_gpu_per_rank(config):
    (name,) = PROFILES["gpu-tp"]
    svc = config["services"][name]
    ranks = int(flag_values(svc["command"])["--tensor-parallel-size"])
    (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert ranks == 2 and int(dev["count"]) == ranks and dev["capabilities"] == ["gpu"]
    assert svc["shm_size"]  # the ranks' processes share tensors through /dev/shm (64 MiB by default)


def test_redis_keeps_an_append_only_file(config):
    redis = config["services"]["redis"]
    assert redis["command"][:2] == ["sh", "-c"]  # writes the password's config file, then starts Redis
    cmd = redis["command"][2].split()
    assert cmd[cmd.index("--appendonly") + 1] == "yes" and cmd[cmd.index("--appendfsync") + 1] == "everysec"
    data_dir = cmd[cmd.index("--dir") + 1]
    assert "redis-data" in config["volumes"]
    assert ("redis-data", data_dir) in [volume(v)[:2] for v in redis["volumes"]]
    assert redis["image"].startswith("redis:7.")


def test_telemetry_wiring(config):
    services = config["services"]
    for name in ("gateway", "celery", *(w for workers in PROFILES.values() for w in workers)):
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
        assert env["OTEL_SERVICE_NAME"].startswith("kvfleet-")
    for name in ("otel-collector", "prometheus", "grafana"):
        for v in services[name]["volumes"]:
            source, _, mode = volume(v)
            if source.startswith("/"):  # a bind mount: v1 resolves ./deploy/... to an absolute path
                assert Path(source).is_relative_to(REPO / "deploy") and Path(source).exists(), v
                assert mode == "ro"
    collector = yaml.safe_load((REPO / "deploy/otel-collector.yaml").read_text())
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_prometheus_scrapes_gateway_and_every_worker(config):
    prom = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = config["services"]
    expected = {f"gateway:{flag_values(services['gateway']['command'])['--port']}"}
    for workers in PROFILES.values():
        expected |= {f"{w}:{flag_values(services[w]['command'])['--metrics-port']}" for w in workers}
    assert targets == expected
    assert all(job["metrics_path"] == "/metrics" for job in prom["scrape_configs"])


def test_redis_has_a_password_from_the_environment_and_no_default():
    proc = run_compose("config", "-q", KVFLEET_REDIS_PASSWORD="")
    assert proc.returncode != 0 and "KVFLEET_REDIS_PASSWORD" in proc.stderr, proc.stderr
    redis = yaml.safe_load(compose("config"))["services"]["redis"]
    assert redis["environment"]["REDISCLI_AUTH"] == PASSWORD  # redis-cli (the healthcheck) authenticates with it
    script = redis["command"][-1]
    assert PASSWORD not in script and "requirepass" in script, "the password goes into a file, not argv"
    assert "grep -q PONG" in redis["healthcheck"]["test"][-1], "NOAUTH must fail the healthcheck"
    assert "docker-entrypoint.sh redis-server" in script, "the image's entrypoint drops root before Redis runs"
    assert all(published(p)[0] == "127.0.0.1" for p in redis["ports"])


def test_redis_memory_is_capped_without_eviction():
    script = yaml.safe_load(compose("config"))["services"]["redis"]["command"][-1].split()
    assert script[script.index("--maxmemory") + 1] == "1gb"
    assert script[script.index("--maxmemory-policy") + 1] == "noeviction", "eviction would drop queued requests"
    assert script[script.index("--appendonly") + 1] == "yes"
    script = yaml.safe_load(compose("config", KVFLEET_REDIS_MAXMEMORY="4gb"))["services"]["redis"]["command"][-1]
    assert "--maxmemory 4gb " in script


def test_gateway_is_published_on_loopback_unless_told_otherwise():
    gateway = yaml.safe_load(compose("config"))["services"]["gateway"]
    assert [published(p)[:2] for p in gateway["ports"]] == [("127.0.0.1", 8000)]
    assert gateway["environment"]["KVFLEET_METRICS_OPEN"] == "1"  # for deploy/prometheus.yml, which sends no key
    opened = yaml.safe_load(compose("config", KVFLEET_GATEWAY_BIND="0.0.0.0", KVFLEET_API_KEYS="sk-1",
                                    KVFLEET_METRICS_OPEN="0"))["services"]["gateway"]
    assert [published(p)[:2] for p in opened["ports"]] == [("0.0.0.0", 8000)]
    assert opened["environment"]["KVFLEET_API_KEYS"] == "sk-1" and opened["environment"]["KVFLEET_METRICS_OPEN"] == "0"
