"""k8s/: the Redis password reaches processes only through environments and an in-memory file, never a command
line (`ps` on the node and the pod spec show those); the Redis StatefulSet's command really starts a Redis
that requires it."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
from deploy_checks import OVERLAYS, containers, find, one, render, run_redis_command
from redis import AuthenticationError, Redis

pytestmark = pytest.mark.deploy


def _secret_env(c: dict) -> set[str]:
    """Names of a container's variables that hold a secret, or a value made from one ($(VAR) references)."""
    names = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    for e in c.get("env", []):  # in order: Kubernetes expands only variables defined earlier
        if any(ref in names for ref in re.findall(r"\$\((\w+)\)", e.get("value", ""))):
            names.add(e["name"])
    return names


def _command_lines(c: dict) -> list[str]:
    """Every argv a container runs: its command and args, exec probes, lifecycle hooks."""
    lines = c.get("command", []) + c.get("args", [])
    hooks = [c.get(p, {}) for p in ("readinessProbe", "livenessProbe", "startupProbe")]
    hooks += list(c.get("lifecycle", {}).values())
    for hook in hooks:
        lines += hook.get("exec", {}).get("command", [])
    return lines


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_command_line_holds_a_secret(overlay):
    """`ps` on the node and the pod spec show command lines: secrets (the Redis password, the URLs made from it,
    API keys) reach processes only through the environment."""
    resources = render(overlay)
    values = {base64.b64decode(v).decode() for s in find(resources, "Secret") for v in s.get("data", {}).values()}
    values |= {v for s in find(resources, "Secret") for v in s.get("stringData", {}).values()}
    for owner, c in containers(resources):
        where = f"{owner['metadata']['name']}/{c['name']}"
        line = " ".join(_command_lines(c))
        for name in _secret_env(c):
            assert f"$({name})" not in line, f"{where}: Kubernetes expands {name} into the command line"
            for step in re.split(r"&&|\|\||;|\|", line):  # a shell may use it only in the builtin printf
                if re.search(rf"\${{?{name}\b", step):
                    assert step.split()[0] == "printf", f"{where}: `{step.strip()}` puts {name} in an argv"
        assert not any(v and v in line for v in values), f"{where}: a secret's value is in the command line"
        assert not {"--requirepass", "--redis-url", "-a", "--pass"} & set(line.split()), where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_password_reaches_redis_through_a_file_in_memory(overlay):
    pod = one(render(overlay), "StatefulSet", "kvfleet-redis")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "kvfleet-secrets", "key": "redis-password"}
    script = c["command"][2]
    conf = re.search(r"printf 'requirepass \"%s\"\\n' \"\$REDISCLI_AUTH\" > (\S+)", script).group(1)
    assert f"exec redis-server {conf} \"$@\"" in script
    mount = next(m for m in c["volumeMounts"] if conf.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory", "the password's file stays off disks"
    # authenticated by REDISCLI_AUTH; NOAUTH must fail them (the liveness probe lets an AOF load: LOADING)
    assert "redis-cli ping | grep -q PONG" in c["readinessProbe"]["exec"]["command"][-1]
    assert "redis-cli ping 2>&1 | grep -qE 'PONG|LOADING'" in c["livenessProbe"]["exec"]["command"][-1]


def test_redis_command_really_starts_an_authenticated_redis(tmp_path):
    """The StatefulSet's command and args, run by a real shell and redis-server with the cpu-dev Secret's
    password in REDISCLI_AUTH: Redis requires it, keeps an AOF, caps memory, and no argv shows it."""
    resources = render("cpu-dev")
    password = base64.b64decode(one(resources, "Secret", "kvfleet-secrets")["data"]["redis-password"]).decode()
    c = one(resources, "StatefulSet", "kvfleet-redis")["spec"]["template"]["spec"]["containers"][0]
    conf_dir = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] != "data")
    with run_redis_command(c["command"] + c["args"], {"REDISCLI_AUTH": password}, password, tmp_path,
                           {conf_dir: "auth", "/data": "data"}) as (pid, client):
        with pytest.raises(AuthenticationError):
            Redis(port=client.connection_pool.connection_kwargs["port"], socket_timeout=5).ping()
        config = client.config_get("*")
        assert (config["appendonly"], config["maxmemory"], config["maxmemory-policy"]) == (
            "yes", str(1024**3), "noeviction")
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        (conf,) = (tmp_path / "auth").iterdir()
        assert conf.stat().st_mode & 0o077 == 0, "the password's file is for the redis user only"
