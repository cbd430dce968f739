"""Ports for the servers kvfleet starts on this machine: free ones for tests and benchmarks, and whether one is free
for `kvfleet up`'s gateways."""
from __future__ import annotations

import random
import socket

LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where outgoing connections get their local ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Can a server listen on host:port now (SO_REUSEADDR, as uvicorn and Redis bind: a closed connection's
    TIME_WAIT does not count)?"""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return True  # a host it cannot resolve: the server's own bind will say
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1, below the kernel's ephemeral range. A port from
    bind(0) is an ephemeral one, which any outgoing connection may take before the server binds it (in CI, a second
    gateway's --port+1 was held by a client socket). Below the range, only another listener can. (An unusual range
    with no room below it: the kernel's choice.)"""
    high, rng = _ephemeral_low() - count, random.SystemRandom()
    while True:
        base = rng.randrange(LOWEST_PORT, high) if high > LOWEST_PORT else _kernel_port()
        if all(bindable(base + i) for i in range(count)):
            return base
