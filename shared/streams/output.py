"""Output streams: a worker appends numbered chunks; the gateway, Celery tasks and the client read them back,
each chunk once (sequence-number dedup), sync or asyncio."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.messages import OutputChunk


class OutputTimeout(TimeoutError):
    """No output chunk arrived within the reader's timeout."""


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


def output_exists(r: redis.Redis, request_id: str) -> bool:
    """The request's output stream is there (it expires a while after its final chunk was read)."""
    return bool(r.exists(keys.out_stream(request_id)))


async def aoutput_exists(r: aioredis.Redis, request_id: str) -> bool:
    return bool(await r.exists(keys.out_stream(request_id)))
