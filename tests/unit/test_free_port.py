"""free_port: ports a server can bind, clear of the kernel's ephemeral range, where outgoing connections take their
local ports (a second gateway's --port+1 in CI was held by one)."""
from __future__ import annotations

import socket

import pytest

from services import ports
from services.ports import free_port

pytestmark = pytest.mark.unit


def test_a_run_of_ports_is_free_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    for count in (1, 2, 4):
        base = free_port(count)
        assert ports.LOWEST_PORT <= base and base + count - 1 < low
        held = []
        try:
            for port in range(base, base + count):  # each binds and listens, as a gateway replica would
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind(("127.0.0.1", port))
                s.listen()
        finally:
            for s in held:
                s.close()


def test_a_run_skips_a_base_whose_next_port_is_taken(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        bases = iter([busy - 1, busy - 1, busy + 1])  # the first two tries would cover the busy port

        class Draws:
            def randrange(self, lo, hi):
                return next(bases)

        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
        monkeypatch.setattr(ports.random, "SystemRandom", Draws)
        assert free_port(2) == busy + 1


def test_an_unusual_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST_PORT)
    base = free_port(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
        a.bind(("127.0.0.1", base))
        b.bind(("127.0.0.1", base + 1))
