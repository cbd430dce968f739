"""The Redis client: how every kvfleet process connects (decode_responses, so `rediss://` and passwords in the
URL work the same everywhere), the Lua-script runner, and the error types callers outside this package catch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis


def connect(url: str, **kwargs: Any) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, **kwargs)


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, **kwargs)


# ---- errors callers catch -------------------------------------------------------------------------
# Modules outside this package catch these instead of importing redis.

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)  # Redis away or too slow: worth a retry
RedisError = redis.RedisError  # any failed command: the worker's threads log it and try again
Client = redis.Redis  # what `connect` returns (the worker's threads share one)


# ---- Lua scripts ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LuaScript:
    """One atomic step, as Lua. Its SHA1 is computed once, here; Redis compiles the source the first time a
    server sees it (and again after a restart lost its script cache): EVALSHA, then on NOSCRIPT one EVAL."""

    source: str

    @property
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
