"""docker-compose.yml: valid for Debian's docker-compose v1 (`config -q`), and true to kvfleet's processes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_checks import REPO, check_command, flag_values

pytestmark = pytest.mark.deploy

PROFILES = {"cpu": ("worker-cpu-0", "worker-cpu-1"), "gpu": ("worker-gpu-0", "worker-gpu-1")}


def compose(*args: str) -> str:
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose (Debian's v1) is missing: `make setup` installs it"
    proc = subprocess.run([exe, "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def volume(entry: str) -> tuple[str, str, str]:
    """(source, target, mode) of a short-syntax volume as docker-compose v1 prints it."""
    source, target, mode = entry.split(":")
    return source, target, mode


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(compose("--profile", "cpu", "--profile", "gpu", "config"))


def test_config_is_valid():
    assert compose("config", "-q") == ""
    for profile in PROFILES:
        assert compose("--profile", profile, "config", "-q") == ""


def test_profiles_select_two_workers_each(config):
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
            assert flags["--device"] == ("cuda" if profile == "gpu" else "cpu")
            assert flags["--redis-url"] == "redis://redis:6379/0" == svc["environment"]["KVFLEET_REDIS_URL"]
            assert flags["--model"] == "smollm2"  # ${KVFLEET_MODEL:-smollm2}
            ids.add(flags["--worker-id"])
            # docker stops it with SIGTERM, then SIGKILL after stop_grace_period: longer than the drain.
            grace = int(svc["stop_grace_period"].rstrip("s"))
            assert grace > float(flags["--drain-timeout"]) + 5
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
            assert "build" in svc, "each service that uses a kvfleet image builds it (no pull attempted)"
    assert len(ids) == 4
    assert services["gateway"]["ports"][0]["target"] == int(flag_values(services["gateway"]["command"])["--port"])


def test_gpu_workers_reserve_one_gpu_each(config):
    devices = []
    for name in PROFILES["gpu"]:
        (dev,) = config["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        devices += dev["device_ids"]
    assert devices == ["0", "1"]
    for name in PROFILES["cpu"]:
        assert "deploy" not in config["services"][name]


def test_redis_keeps_an_append_only_file(config):
    redis = config["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    data_dir = cmd[cmd.index("--dir") + 1]
    assert "redis-data" in config["volumes"]
    assert ("redis-data", data_dir) in [volume(v)[:2] for v in redis["volumes"]]
    assert redis["image"].startswith("redis:7.")


def test_telemetry_wiring(config):
    services = config["services"]
    for name in ("gateway", "celery", *PROFILES["cpu"], *PROFILES["gpu"]):
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
