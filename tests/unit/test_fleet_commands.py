"""The children `kvfleet up` starts (services.launcher.fleet_commands): --gateways N gateway replicas on
consecutive ports, each with the same routing, then the workers."""

from __future__ import annotations

import socket

import pytest

from services.cli import build_parser
from services.launcher import fleet_commands
from shared.settings import Settings

pytestmark = pytest.mark.unit


def test_gateway_replicas_listen_on_consecutive_ports_before_the_workers():
    args = build_parser().parse_args(["up", "--gateways", "3", "--workers", "2", "--port", "9100",
                                      "--routing", "prefix"])
    cmds = fleet_commands(args, Settings(model="smollm2"), private=True)
    assert [name for name, _ in cmds] == ["gateway", "gateway-1", "gateway-2", "w0", "w1"]
    gateways = [cmd for _, cmd in cmds[:3]]
    assert [cmd[cmd.index("--port") + 1] for cmd in gateways] == ["9100", "9101", "9102"]
    assert all(cmd[cmd.index("--routing") + 1] == "prefix" and "gateway" in cmd for cmd in gateways)


def test_one_gateway_by_default():
    cmds = fleet_commands(build_parser().parse_args(["up"]), Settings(model="smollm2"), private=True)
    assert [name for name, _ in cmds] == ["gateway", "w0"]


def test_no_warmup_reaches_every_worker():
    cmds = fleet_commands(build_parser().parse_args(["up", "--workers", "2", "--no-warmup"]), Settings(model="smollm2"),
                          private=True)
    assert [("--no-warmup" in cmd) for _, cmd in cmds] == [False, True, True]


def test_async_output_reaches_every_worker_and_no_gateway():
    args = build_parser().parse_args(["up", "--workers", "2", "--async-output"])
    cmds = fleet_commands(args, Settings(model="smollm2"), private=True)
    assert [("--async-output" in cmd) for _, cmd in cmds] == [False, True, True]
    worker = build_parser().parse_args(cmds[1][1][cmds[1][1].index("worker"):])
    assert worker.async_output is True
    assert [("--async-output" in cmd) for _, cmd in fleet_commands(build_parser().parse_args(["up"]),
                                                                   Settings(model="smollm2"), private=True)] == \
        [False, False]


def test_up_refuses_a_gateway_port_in_use_before_it_starts_anything(tmp_path):
    """Another fleet (or any server) on --port + 1: `kvfleet up --gateways 2` says which port and what to do, before
    its Redis starts or a worker loads the model (the gateway's own bind failed only after both)."""
    from services import launcher
    from services.ports import free_port

    base = free_port(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", base + 1))
        other.listen()
        args = build_parser().parse_args(["up", "--gateways", "2", "--port", str(base),
                                          "--data-dir", str(tmp_path / "redis")])
        with pytest.raises(SystemExit) as refused:
            launcher.run(args)
    message = str(refused.value)
    assert f"port {base + 1} on 127.0.0.1 is in use" in message and "--port" in message
    assert f"{base}-{base + 1}" in message
    assert not (tmp_path / "redis").exists()


def test_up_checks_the_port_as_the_gateway_binds_it_a_closed_connection_is_no_obstacle():
    """A port whose last connection is in TIME_WAIT binds with SO_REUSEADDR, as uvicorn's does: not "in use"."""
    from services.ports import bindable, free_port

    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert not bindable(port)
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end goes to TIME_WAIT
        client.close()
    assert bindable(port)
