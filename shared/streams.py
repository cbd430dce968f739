"""The request and output streams: the one place a request enters the fleet, output chunks are written,
and output is read back (with sequence-number dedup), for the gateway, the Celery tasks and the client.

Sync (`redis.Redis`) and asyncio (`redis.asyncio.Redis`) callers share the command builders; every client
is made by `connect` / `connect_async` with decode_responses=True, so `rediss://` and passwords in the URL
work the same everywhere.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.messages import GenerationRequest, OutputChunk

CANCEL_STREAM_MAXLEN = 10_000
CANCEL_MARK_TTL_S = 3600


class OutputTimeout(TimeoutError):
    """No output chunk arrived within the reader's timeout."""


def connect(url: str, **kwargs: Any) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, **kwargs)


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5, **kwargs)


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


# ---- requests -------------------------------------------------------------------------------------

# Atomic "reserve and enqueue on a worker, if it still has the room the router saw": the status and the
# reservations are re-read inside Redis, so concurrent gateways never over-commit a worker.
_ENQUEUE_ROUTED = LuaScript("""
local blocks, min_headroom = tonumber(ARGV[2]), tonumber(ARGV[3])
if min_headroom >= 0 then
  local raw = redis.call('GET', KEYS[1])
  if not raw then return false end
  local s = cjson.decode(raw)
  local reserved = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do reserved = reserved + tonumber(v) end
  if s['free_blocks'] - s['promised_blocks'] - reserved - blocks < min_headroom then return false end
end
if blocks > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], blocks)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return redis.call('XADD', KEYS[3], '*', ARGV[6], ARGV[5])
""")

# Atomic "enqueue on the shared stream unless more than `bound` requests already wait there untaken".
_ENQUEUE_SHARED = LuaScript("""
local bound = tonumber(ARGV[1])
if bound >= 0 then
  local waiting = redis.call('XLEN', KEYS[1])
  local pending = redis.pcall('XPENDING', KEYS[1], ARGV[2])
  if type(pending) == 'table' and pending['err'] == nil then waiting = waiting - pending[1] end
  if waiting >= bound then return false end
end
return redis.call('XADD', KEYS[1], '*', ARGV[4], ARGV[3])
""")


def enqueue_commands(pipe: Any, request: GenerationRequest, worker_id: str | None,
                     *, reservation_ttl_s: float = 30.0) -> None:
    """Queue on `pipe` (sync or async pipeline): the reservation of the request's blocks on the chosen
    worker, then the XADD to its stream (kvfleet:req:any when `worker_id` is None). No capacity checks."""
    if worker_id is not None and request.kv_blocks > 0:
        pipe.hset(keys.reserved(worker_id), request.request_id, request.kv_blocks)
        pipe.pexpire(keys.reserved(worker_id), int(reservation_ttl_s * 1000))
    stream = keys.REQ_ANY if worker_id is None else keys.req_stream(worker_id)
    pipe.xadd(stream, {keys.FIELD: request.model_dump_json()})


def enqueue(r: redis.Redis, request: GenerationRequest, worker_id: str | None, **kw: Any) -> str:
    pipe = r.pipeline(transaction=True)
    enqueue_commands(pipe, request, worker_id, **kw)
    return pipe.execute()[-1]


async def aenqueue(r: aioredis.Redis, request: GenerationRequest, worker_id: str | None, **kw: Any) -> str:
    pipe = r.pipeline(transaction=True)
    enqueue_commands(pipe, request, worker_id, **kw)
    return (await pipe.execute())[-1]


async def aenqueue_routed(r: aioredis.Redis, request: GenerationRequest, worker_id: str, *,
                          min_headroom: int | None, reservation_ttl_s: float = 30.0) -> str | None:
    """Reserve `request.kv_blocks` on the worker and enqueue there, atomically; with `min_headroom` set, only
    if the worker's free blocks less queued and reserved ones still leave that many after this request.
    None: it no longer fits (route again)."""
    return await arun_script(
        r, _ENQUEUE_ROUTED, [keys.status(worker_id), keys.reserved(worker_id), keys.req_stream(worker_id)],
        [request.request_id, request.kv_blocks, -1 if min_headroom is None else min_headroom,
         int(reservation_ttl_s * 1000), request.model_dump_json(), keys.FIELD])


async def aenqueue_shared(r: aioredis.Redis, request: GenerationRequest, *, bound: int | None) -> str | None:
    """Enqueue on kvfleet:req:any, atomically refusing (None) when `bound` requests already wait untaken."""
    return await arun_script(r, _ENQUEUE_SHARED, [keys.REQ_ANY],
                             [-1 if bound is None else bound, keys.GROUP, request.model_dump_json(), keys.FIELD])


def parse_request(fields: dict[str, str]) -> GenerationRequest:
    return GenerationRequest.model_validate_json(fields[keys.FIELD])


# ---- cancels --------------------------------------------------------------------------------------

def cancel_commands(pipe: Any, request_id: str) -> None:
    pipe.set(keys.cancelled(request_id), 1, ex=CANCEL_MARK_TTL_S)
    pipe.xadd(keys.CANCEL, {keys.FIELD: request_id}, maxlen=CANCEL_STREAM_MAXLEN, approximate=True)


def cancel(r: redis.Redis, request_id: str) -> None:
    pipe = r.pipeline(transaction=False)
    cancel_commands(pipe, request_id)
    pipe.execute()


async def acancel(r: aioredis.Redis, request_id: str) -> None:
    pipe = r.pipeline(transaction=False)
    cancel_commands(pipe, request_id)
    await pipe.execute()


# ---- output ---------------------------------------------------------------------------------------

def add_chunk_commands(pipe: Any, chunk: OutputChunk, ttl_s: float) -> None:
    """Worker side: append one chunk to the request's output stream and push its expiry out."""
    stream = keys.out_stream(chunk.request_id)
    pipe.xadd(stream, {keys.FIELD: chunk.model_dump_json(exclude_defaults=True)})
    pipe.pexpire(stream, int(ttl_s * 1000))


def read_all_chunks(r: redis.Redis, request_id: str) -> list[OutputChunk]:
    """Everything written so far (a worker resuming a request, a Celery task checking for a result)."""
    return [OutputChunk.model_validate_json(f[keys.FIELD]) for _, f in r.xrange(keys.out_stream(request_id))]


class ChunkDeduper:
    """Drops chunks whose sequence number was already relayed (a resumed request may rewrite some)."""

    def __init__(self) -> None:
        self.last_seq = -1

    def accept(self, chunk: OutputChunk) -> bool:
        if chunk.seq <= self.last_seq:
            return False
        self.last_seq = chunk.seq
        return True


def _parse_xread(reply: Any) -> tuple[str | None, list[OutputChunk]]:
    last_id, chunks = None, []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            last_id = entry_id
            chunks.append(OutputChunk.model_validate_json(fields[keys.FIELD]))
    return last_id, chunks


class _OutputCursor:
    """Where a reader of one output stream stands: the last entry read, the chunks already given (each is
    given once), and when it gives up. `iter_output` and `aiter_output` differ only in how they call Redis."""

    def __init__(self, request_id: str, timeout_s: float):
        self.request_id, self.timeout_s = request_id, timeout_s
        self.stream, self.last_id, self.dedup = keys.out_stream(request_id), "0-0", ChunkDeduper()
        self.deadline = time.monotonic() + timeout_s

    def streams(self) -> dict[str, str]:
        """XREAD's argument; OutputTimeout once nothing came for timeout_s."""
        if time.monotonic() > self.deadline:
            raise OutputTimeout(f"no output for request {self.request_id} in {self.timeout_s:g}s")
        return {self.stream: self.last_id}

    def new_chunks(self, reply: Any) -> list[OutputChunk]:
        new_id, chunks = _parse_xread(reply)
        if new_id is None:
            return []
        self.last_id, self.deadline = new_id, time.monotonic() + self.timeout_s
        return [c for c in chunks if self.dedup.accept(c)]


def iter_output(r: redis.Redis, request_id: str, *, timeout_s: float = 600.0, block_ms: int = 1000,
                expire_after_s: float = 120.0) -> Iterator[OutputChunk]:
    """Yield the request's chunks in order, each once, until the final one; OutputTimeout when none comes
    for `timeout_s`. After the final chunk the stream expires in `expire_after_s`."""
    cursor = _OutputCursor(request_id, timeout_s)
    while True:
        for chunk in cursor.new_chunks(r.xread(cursor.streams(), block=block_ms, count=256)):
            yield chunk
            if chunk.final:
                r.pexpire(cursor.stream, int(expire_after_s * 1000))
                return


async def aiter_output(r: aioredis.Redis, request_id: str, *, timeout_s: float = 600.0, block_ms: int = 1000,
                       expire_after_s: float = 120.0) -> AsyncIterator[OutputChunk]:
    """The asyncio twin of `iter_output`."""
    cursor = _OutputCursor(request_id, timeout_s)
    while True:
        for chunk in cursor.new_chunks(await r.xread(cursor.streams(), block=block_ms, count=256)):
            yield chunk
            if chunk.final:
                await r.pexpire(cursor.stream, int(expire_after_s * 1000))
                return
