"""The Redis client: how every kvfleet process connects (decode_responses, so `rediss://` and passwords in the
URL work the same everywhere), the Lua-script runner, and the error types callers outside this package catch."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

# A command that meets a dropped connection reconnects and is sent again, RETRIES times, after 50 ms, 100 ms,
# 200 ms (jittered): a blip costs nothing, while an outage surfaces within a second as a ConnectionError (the
# gateway answers 503; the worker's threads and the output readers keep trying with their own backoff).
RETRIES = 3


def _retry_options(for_asyncio: bool) -> dict[str, Any]:
    backoff = ExponentialWithJitterBackoff(base=0.05, cap=0.5)
    retry = (AsyncRetry if for_asyncio else Retry)(backoff, RETRIES)
    return {"retry": retry, "retry_on_error": [redis.ConnectionError, redis.TimeoutError]}


# A client that never sends a command twice, for callers whose commands are not safe to repeat: a consumer-group
# read (XREADGROUP >) or a claim whose reply was lost with the connection (Redis stopped just after answering, a
# socket timeout) has run all the same, and a blind resend reads the entries after it, leaving those it delivered
# pending on a consumer that never got them. The worker's reader threads use it and look for those themselves
# after a failed turn (gpu_worker.serve.intake).
NO_RESEND = {"retry": Retry(NoBackoff(), 0)}


# Text that is not UTF-8 (bytes another program wrote into a key kvfleet reads) is read with U+FFFD in place of
# what cannot be decoded, not raised: a UnicodeDecodeError failed the whole read (every read of the fleet, a
# gateway's inbox read stuck on one entry); decoded, the value is then refused as any other it cannot parse.
# kvfleet writes UTF-8 only (JSON, ids), so for its own data this changes nothing.
TEXT = {"decode_responses": True, "encoding_errors": "replace"}


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_url(url: str) -> str | None:
    """A Redis Cluster URL (redis+cluster://host:port, rediss+cluster://...: any one node) as redis-py's cluster
    client takes it (redis://...); None for a single server's URL."""
    scheme, sep, rest = url.partition("://")
    return f"{CLUSTER_SCHEMES[scheme]}://{rest}" if sep and scheme in CLUSTER_SCHEMES else None


def connect(url: str, *, resend: bool = True, **kwargs: Any) -> redis.Redis:
    """A client of the server, or of the cluster (the client discovers every master and sends each command to
    the one that holds its keys' slot; it retries a moved slot or a failed node itself). `resend=False`: a
    command that meets a dropped connection fails at once instead of being sent again (NO_RESEND)."""
    if (node := cluster_url(url)) is not None:
        kwargs.pop("health_check_interval", None)
        if not resend:
            kwargs |= NO_RESEND
        return redis.RedisCluster.from_url(node, socket_connect_timeout=5, **TEXT | kwargs)
    return redis.Redis.from_url(url, socket_connect_timeout=5,
                                **TEXT | (_retry_options(False) if resend else NO_RESEND) | kwargs)


def connect_async(url: str, *, max_connections: int | None = None, **kwargs: Any) -> aioredis.Redis:
    """With `max_connections` (a gateway: one connection per output stream read at once), a pool that makes a
    command wait up to 30 s for a free connection past that many, instead of failing with "Too many connections"
    (redis-py's default pool fails past 100). On a cluster, at most that many per master (past them a command
    fails: redis-py's cluster client has no waiting pool)."""
    if (node := cluster_url(url)) is not None:
        kwargs.pop("health_check_interval", None)
        return aioredis.RedisCluster.from_url(node, socket_connect_timeout=5, max_connections=max_connections or 100,
                                              **TEXT | kwargs)
    options = dict(socket_connect_timeout=5) | TEXT | _retry_options(True) | kwargs
    if max_connections is None:
        return aioredis.Redis.from_url(url, **options)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30, **options)
    return aioredis.Redis.from_pool(pool)


# ---- stream reads that name their node ------------------------------------------------------------
# XREAD and XREADGROUP name their keys after STREAMS, so Redis's command table marks them "movablekeys", and
# redis-py's cluster client asks the server where their keys are (COMMAND GETKEYS) before each call: one more
# round trip per read. Every read here is of one shard's keys, so the cluster client is told the node.

def _stream_args(streams: dict[str, str], count: int | None, block_ms: int | None) -> list[Any]:
    args: list[Any] = []
    if count:
        args += ["COUNT", count]
    if block_ms is not None:
        args += ["BLOCK", block_ms]
    return args + ["STREAMS", *streams, *streams.values()]


def _node(r: Any, streams: dict[str, str]) -> dict[str, Any]:
    if isinstance(r, redis.RedisCluster | aioredis.RedisCluster):
        return {"target_nodes": r.get_node_from_key(next(iter(streams)))}
    return {}


def xread(r: Any, streams: dict[str, str], *, count: int | None = None, block_ms: int | None = None) -> Any:
    """XREAD (sync or asyncio client: await the result of the latter)."""
    return r.execute_command("XREAD", *_stream_args(streams, count, block_ms), **_node(r, streams))


def xreadgroup(r: Any, group: str, consumer: str, streams: dict[str, str], *, count: int | None = None,
               block_ms: int | None = None) -> Any:
    """XREADGROUP (sync or asyncio client: await the result of the latter)."""
    return r.execute_command("XREADGROUP", "GROUP", group, consumer, *_stream_args(streams, count, block_ms),
                             **_node(r, streams))


# ---- errors callers catch -------------------------------------------------------------------------
# Modules outside this package catch these instead of importing redis.

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)  # Redis away or too slow: worth a retry
AuthenticationError = redis.AuthenticationError  # a missing or wrong password (a ConnectionError too)
RedisError = redis.RedisError  # any failed command: the worker's threads log it and try again
Client = redis.Redis  # what `connect` returns (the worker's threads share one)


FULL = ("Redis is full: it is at its maxmemory under the noeviction policy and refuses writes until memory frees "
        "(outputs read or expired, job records expired); nothing queued is dropped. Raise its maxmemory "
        "(`kvfleet up --redis-maxmemory`, KVFLEET_REDIS_MAXMEMORY for docker-compose, the --maxmemory of the "
        "Redis of k8s/), or read what is waiting")


CANNOT_PERSIST = ("Redis refuses writes: it cannot save them to disk (MISCONF: its AOF or snapshot could not be "
                  "written; a full or read-only data volume, say) and takes none, PEXPIRE and deletes included, until "
                  "a write to disk succeeds again; nothing queued is dropped. Free space on its data volume (or fix "
                  "its persistence: `redis-cli INFO persistence` says what failed)")


def cannot_persist(e: BaseException) -> bool:
    """Redis refused a write because it cannot persist it (MISCONF), from a command or inside a script (Redis 6
    wraps it: "Error running script ...: -MISCONF ..."). Reads still work then."""
    return isinstance(e, redis.ResponseError) and (str(e).startswith("MISCONF") or "-MISCONF " in str(e))


def write_refused(e: BaseException) -> str:
    """Why Redis refused a write: "full" (out_of_memory), "cannot persist" (cannot_persist); "" for any other
    error. The worker's outbox and the 503s of every door (gateway.errors.refusal) tell the two apart by it."""
    return "full" if out_of_memory(e) else "cannot persist" if cannot_persist(e) else ""


def out_of_memory(e: BaseException) -> bool:
    """Redis refused a write because it is full (maxmemory, noeviction): OOM, from a command or inside a script.
    Reads, deletes, acks and PEXPIRE still work then."""
    return isinstance(e, redis.ResponseError) and "command not allowed when used memory" in str(e)


class KeyOfAnotherType(redis.ResponseError):
    """WRONGTYPE, named: `key` holds a `found` where kvfleet keeps an `expected` (shared.keys.TYPES)."""

    def __init__(self, key: str, found: str, expected: str):
        self.key, self.found, self.expected = key, found, expected
        super().__init__(
            f"Redis key {key!r} holds a {found} where kvfleet keeps a {expected}: another program (or kvfleet "
            f"version) wrote it there. kvfleet deletes no key it did not write: see what it holds (redis-cli TYPE "
            f"'{key}'), then delete it (redis-cli DEL '{key}'); the fleet goes on by itself once it is gone")


def wrong_type(e: BaseException) -> bool:
    """The command met a key of another Redis type (WRONGTYPE, named or not; alone, or inside a script's or a
    pipeline's error): another program's or version's write."""
    return isinstance(e, KeyOfAnotherType) or isinstance(e, redis.ResponseError) and "WRONGTYPE Operation" in str(e)


def group_missing(e: Exception) -> bool:
    """The error says a consumer group or its stream is missing (NOGROUP; XINFO's "no such key"): Redis
    restarted without its data, or was flushed. The worker then creates its groups again and re-registers."""
    return isinstance(e, redis.ResponseError) and (str(e).startswith("NOGROUP") or "no such key" in str(e))


# ---- Lua scripts ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LuaScript:
    """One atomic step, as Lua. Its SHA1 is computed once, here; Redis compiles the source the first time a
    server sees it (and again after a restart lost its script cache): EVALSHA, then on NOSCRIPT one EVAL."""

    source: str

    @functools.cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


def run_script(r: redis.Redis, script: LuaScript, keys_: list[str], args: list[Any]) -> Any:
    try:
        return r.evalsha(script.sha, len(keys_), *keys_, *args)
    except redis.exceptions.NoScriptError:
        return r.eval(script.source, len(keys_), *keys_, *args)


async def arun_script(r: aioredis.Redis, script: LuaScript, keys_: list[str], args: list[Any]) -> Any:
    try:
        return await r.evalsha(script.sha, len(keys_), *keys_, *args)
    except redis.exceptions.NoScriptError:
        return await r.eval(script.source, len(keys_), *keys_, *args)
