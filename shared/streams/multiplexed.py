"""A multiplexed Redis connection for a hot path: one socket per client, commands written as they come and their
replies matched to them in order (Redis answers a connection's commands in the order it sent them), parsed by
hiredis. redis-py's asyncio client spends about 100 us of CPU on each command (its connection pool, retry
wrapper, timeouts and observability hooks; 97-117 us for a GET on a 2-core Zen 3, one command at a time); this
spends about 10. The gateway sends its per-request commands through it (the enqueue script, the inbox's read):
at a thousand requests a second that is a tenth of a core.

It speaks RESP2 to one server over TCP or a unix socket, with the URL's password, user and database. What it
does not do, redis-py's client still does: TLS (`rediss://`) and Redis Cluster get None from `multiplexed`, and
their callers keep using redis-py. Errors are redis-py's own classes (ConnectionError, ResponseError and its
kinds, NoScriptError...), so callers catch the same things whichever client they hold. A command that meets a
dropped connection (Redis restarted, the client killed) reconnects and is sent again, RETRIES times with
redis-py's backoff, as redis-py's client does; a command already written when the connection dropped may have
run (the same at-least-once as redis-py's retry).

A blocking command (XREAD BLOCK) holds the connection until it returns: give it a client of its own.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import hiredis
import redis
from redis._parsers.base import BaseParser
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url

from shared.streams.client import RETRIES, cluster_url


class _Error(Exception):
    """What hiredis makes of an error reply; turned into redis-py's class for it (BaseParser.parse_error)."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", errors="replace", replyError=_Error)  # as client.TEXT
        self.pending: deque[asyncio.Future] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending = self.pending
        while (reply := self.reader.gets()) is not False:
            waiter = pending.popleft()
            if waiter.done():  # its caller was cancelled: the reply is read past
                continue
            if isinstance(reply, _Error):
                waiter.set_exception(BaseParser.parse_error(str(reply)))
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = redis.ConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        while self.pending:
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)

    def send(self, args: tuple) -> asyncio.Future:
        waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(hiredis.pack_command(args))
        self.pending.append(waiter)
        return waiter


class Multiplexed:
    """One connection to the server at `url` (made on first use, made again after it dropped)."""

    def __init__(self, url: str, *, connect_timeout_s: float = 5.0):
        options = parse_url(url)
        self.path: str | None = options.get("path")
        self.host, self.port = options.get("host", "localhost"), int(options.get("port", 6379))
        self.username, self.password = options.get("username"), options.get("password")
        self.db = int(options.get("db") or 0)
        self.connect_timeout_s = connect_timeout_s
        self.backoff = ExponentialWithJitterBackoff(base=0.05, cap=0.5)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future | None = None
        self._closed = False

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        if self._closed:
            raise redis.ConnectionError("the multiplexed Redis connection is closed")
        if self._connecting is None:  # one connect at a time; every caller meanwhile waits for it
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.path:
                    _, conn = await loop.create_unix_connection(_Connection, self.path)
                else:
                    _, conn = await loop.create_connection(_Connection, self.host, self.port)
                if self.password is not None:
                    auth = (self.username, self.password) if self.username else (self.password,)
                    await conn.send(("AUTH", *auth))
                if self.db:
                    await conn.send(("SELECT", self.db))
        except (OSError, TimeoutError) as e:
            where = self.path or f"{self.host}:{self.port}"
            raise redis.ConnectionError(f"cannot connect to Redis at {where}: {e or type(e).__name__}") from None
        self._conn = conn
        return conn

    async def execute_command(self, *args: Any) -> Any:
        """The command's reply as RESP2 gives it (strings decoded; no redis-py response callbacks)."""
        for attempt in range(RETRIES + 1):
            try:
                conn = await self._connection()
                return await conn.send(args)
            except redis.ConnectionError:
                if attempt == RETRIES or self._closed:
                    raise
                await asyncio.sleep(self.backoff.compute(attempt + 1))
        raise AssertionError("unreachable")

    def evalsha(self, sha: str, numkeys: int, *args: Any) -> Any:
        return self.execute_command("EVALSHA", sha, numkeys, *args)

    def eval(self, script: str, numkeys: int, *args: Any) -> Any:
        return self.execute_command("EVAL", script, numkeys, *args)

    async def aclose(self) -> None:
        self._closed = True
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()


def multiplexed(url: str) -> Multiplexed | None:
    """A multiplexed client of the server at `url`; None for what it does not speak (a cluster, TLS)."""
    if cluster_url(url) is not None or url.startswith("rediss://"):
        return None
    return Multiplexed(url)
