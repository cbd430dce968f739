"""The children `kvfleet up` starts (services.launcher.fleet_commands): --gateways N gateway replicas on
consecutive ports, each with the same routing, then the workers."""

from __future__ import annotations

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
