"""Output streams: a worker appends numbered chunks; the gateway, Celery tasks and the client read them back,
each chunk once (sequence-number dedup), sync or asyncio. A gateway's requests (reply_to set) have no stream of
their own: their chunks arrive batched in the gateway's inbox (one entry per worker flush; `aread_inbox`). A reader rides out a Redis outage of up to its
grace and goes on after the last entry it read; it fails with RedisAway past the grace, and with OutputLost
when Redis came back without the request (restarted without its data), instead of waiting for its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from pydantic import TypeAdapter, ValidationError

from shared import keys
from shared.messages import OutputChunk
from shared.streams.client import CONNECTION_ERRORS, wrong_type, xread
from shared.streams.key_types import READS_OF_A_TYPE_THAT_CHANGED, afind, find

log = logging.getLogger("kvfleet.streams")


class OutputTimeout(TimeoutError):
    """No output chunk arrived within the reader's timeout."""



def add_chunk_commands(pipe: Any, chunk: OutputChunk, ttl_s: float, shard: int) -> None:
    """Append one chunk to the request's output stream (in `shard`) and push its expiry out."""
    stream = keys.out_stream(chunk.request_id, shard)
    pipe.xadd(stream, {keys.FIELD: chunk.model_dump_json(exclude_defaults=True)})
    pipe.pexpire(stream, int(ttl_s * 1000))


async def arestore_output(r: aioredis.Redis, request_id: str, chunks: list[OutputChunk], ttl_s: float,
                          shard: int) -> None:
    """Gateway side: write chunks it already relayed into a fresh output stream (renamed to `request_id`) in
    the shard it is about to be enqueued in, so the worker that takes it resumes after them (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for chunk in chunks:
        add_chunk_commands(pipe, chunk.model_copy(update={"request_id": request_id}), ttl_s, shard)
    await pipe.execute()


def read_all_chunks(r: redis.Redis, request_id: str, shard: int = 0) -> list[OutputChunk]:
    """Everything written so far (a worker resuming a request, a Celery task checking for a result)."""
    return [OutputChunk.model_validate_json(f[keys.FIELD]) for _, f in r.xrange(keys.out_stream(request_id, shard))]


class ChunkDeduper:
    """Drops chunks whose sequence number was already relayed (a resumed request may rewrite some), and chunks
    from a writer that lost the request: an owner token older than one already seen."""

    def __init__(self) -> None:
        self.last_seq = -1
        self.owner: tuple[int, int] = (0, 0)

    def accept(self, chunk: OutputChunk) -> bool:
        if chunk.seq <= self.last_seq or chunk.owner_token() < self.owner:
            return False
        self.last_seq, self.owner = chunk.seq, chunk.owner_token()
        return True

    def accept_next(self, chunk: OutputChunk) -> bool:
        """`accept`, for a reader that saw the stream from its start: a chunk past the next sequence number
        means chunks were lost (Redis restarted without its data while the worker went on writing)."""
        if chunk.seq > self.last_seq + 1:
            raise OutputLost(f"Redis lost chunks {self.last_seq + 1}..{chunk.seq - 1} of request {chunk.request_id} "
                             "(it restarted without its data); retry the request")
        return self.accept(chunk)


def _parse_xread(reply: Any) -> tuple[str | None, list[OutputChunk]]:
    last_id, chunks = None, []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            last_id = entry_id
            chunks.append(OutputChunk.model_validate_json(fields[keys.FIELD]))
    return last_id, chunks


SILENCE_CHECK_S = 5.0  # a reader that got output, then none for this long, checks that its stream still exists


class _OutputCursor:
    """Where a reader of one output stream stands: the last entry read, the chunks already given (each is
    given once), when it gives up, and whether Redis is away. `iter_output` and `aiter_output` differ only
    in how they call Redis and sleep."""

    def __init__(self, request_id: str, shard: int, timeout_s: float, grace_s: float,
                 entry: tuple[str, str] | None, after_seq: int = -1):
        self.request_id, self.timeout_s, self.grace_s, self.entry = request_id, timeout_s, grace_s, entry
        self.stream, self.last_id, self.dedup = keys.out_stream(request_id, shard), "0-0", ChunkDeduper()
        self.dedup.last_seq = after_seq
        self.deadline = time.monotonic() + timeout_s
        self.down_since: float | None = None
        self.next_silence_check = time.monotonic() + SILENCE_CHECK_S
        self.failures = 0
        self.type_changes = 0  # reads in a row refused for a type their keys no longer held (type_changed)

    def streams(self) -> dict[str, str]:
        """XREAD's argument; OutputTimeout once nothing came for timeout_s."""
        if time.monotonic() > self.deadline:
            raise OutputTimeout(f"no output for request {self.request_id} in {self.timeout_s:g}s")
        return {self.stream: self.last_id}

    def names(self) -> list[str]:
        """The keys a read touches: the output stream, and the request's stream when its entry is checked."""
        return [self.stream, *([self.entry[0]] if self.entry else [])]

    def failed(self, e: Exception) -> float:
        """A read met a dropped connection: the seconds to wait before the next try (doubling from 0.05 s up
        to 1 s); RedisAway once Redis has been away for longer than grace_s."""
        now = time.monotonic()
        self.down_since = self.down_since or now
        away = now - self.down_since
        if away >= self.grace_s:
            raise RedisAway(f"lost the connection to Redis for more than {self.grace_s:g}s (redis_grace_s) while "
                            f"reading the output of request {self.request_id} ({type(e).__name__}: {e}); retry the "
                            "request once Redis is back") from e
        self.failures += 1
        return min(0.05 * 2 ** (self.failures - 1), 1.0, self.grace_s - away)

    def should_check(self, got_reply: bool) -> bool:
        """After a successful read, is it time to check that Redis kept the request? Once after an outage
        (nothing new read), and every SILENCE_CHECK_S without output once some came (a FLUSHALL drops no
        connection; a stream that had output vanishes only with Redis's data, so that check cannot misfire)."""
        now = time.monotonic()
        if got_reply:
            self.next_silence_check = now + SILENCE_CHECK_S
        if self.down_since is not None:
            self.down_since, self.failures = None, 0
            return not got_reply
        if not got_reply and self.dedup.last_seq >= 0 and now >= self.next_silence_check:
            self.next_silence_check = now + SILENCE_CHECK_S
            return True
        return False

    def type_changed(self, e: Exception) -> bool:
        """A read refused for a key's type (WRONGTYPE) while none of its keys holds another type now: the key expired
        or was deleted in between (a Redis paused past another program's string's TTL), so read again, up to
        READS_OF_A_TYPE_THAT_CHANGED times in a row."""
        if not wrong_type(e) or self.type_changes >= READS_OF_A_TYPE_THAT_CHANGED:
            return False
        self.type_changes += 1
        return True

    def check_kept(self, output_exists: bool, entry_exists: bool) -> None:
        """After an outage with nothing new read: OutputLost when Redis restarted without the request (its
        output stream, seen before, is gone; or no output yet and its request entry is gone)."""
        if output_exists or (self.dedup.last_seq < 0 and (self.entry is None or entry_exists)):
            return
        raise OutputLost(f"Redis lost request {self.request_id} (it restarted without its data, or was flushed); "
                         "retry the request")

    def check_lease(self, lost: Callable[[], bool] | None) -> None:
        """OutputLost when the holder of the request's lease found it gone (gateway.leases)."""
        if lost is not None and lost():
            raise OutputLost(f"Redis lost request {self.request_id}: its lease vanished (Redis restarted without "
                             "its data or was flushed, or the gateway stalled past the lease TTL)")

    def new_chunks(self, reply: Any) -> list[OutputChunk]:
        self.type_changes = 0
        new_id, chunks = _parse_xread(reply)
        if new_id is None:
            return []
        self.last_id, self.deadline = new_id, time.monotonic() + self.timeout_s
        return [c for c in chunks if self.dedup.accept_next(c)]


class RedisOutage(redis.ConnectionError):
    """Reading a request's output failed for good because of Redis. A ConnectionError (streams.CONNECTION_ERRORS),
    so callers that retry on those (Celery's autoretry) place the request again."""


class RedisAway(RedisOutage):
    """Redis stayed unreachable for longer than the reader's grace."""


class OutputLost(RedisOutage):
    """Redis no longer holds the request: its output or its entry vanished (a restart without persistence)."""


def iter_output(r: redis.Redis, request_id: str, shard: int = 0, *, timeout_s: float = 600.0, block_ms: int = 1000,
                expire_after_s: float = 120.0, grace_s: float = 15.0,
                entry: tuple[str, str] | None = None) -> Iterator[OutputChunk]:
    """Yield the request's chunks in order, each once, until the final one; OutputTimeout when none comes
    for `timeout_s`. After the final chunk the stream expires in `expire_after_s`. A dropped connection
    pauses the reader for up to `grace_s` (then RedisAway); once back it goes on after the last entry read,
    or raises OutputLost if Redis lost the request (`entry`, its (request stream, entry id), lets it tell
    before any output came); so it does when the stream it read from vanished (a FLUSHALL, checked after
    SILENCE_CHECK_S without output)."""
    cursor = _OutputCursor(request_id, shard, timeout_s, grace_s, entry)
    while True:
        try:
            reply, kept = xread(r, cursor.streams(), block_ms=block_ms, count=256), None
            if cursor.should_check(bool(reply)):
                kept = bool(r.exists(cursor.stream)), bool(entry and r.xrange(entry[0], entry[1], entry[1]))
        except CONNECTION_ERRORS as e:
            time.sleep(cursor.failed(e))
            continue
        except redis.ResponseError as e:
            if wrong_type(e) and (found := find(r, cursor.names())):
                raise found[0] from e  # the worker writes past it: no chunk would ever come
            if cursor.type_changed(e):
                continue
            raise
        if kept:
            cursor.check_kept(*kept)
        for chunk in cursor.new_chunks(reply):
            yield chunk
            if chunk.final:
                with contextlib.suppress(*CONNECTION_ERRORS):  # best effort: the stream has its own expiry
                    r.pexpire(cursor.stream, int(expire_after_s * 1000))
                return


async def aiter_output(r: aioredis.Redis, request_id: str, shard: int = 0, *, timeout_s: float = 600.0, block_ms: int = 1000,
                       expire_after_s: float = 120.0, grace_s: float = 15.0,
                       entry: tuple[str, str] | None = None, after_seq: int = -1,
                       lost: Callable[[], bool] | None = None,
                       expire_later: Callable[[str], None] | None = None) -> AsyncIterator[OutputChunk]:
    """The asyncio twin of `iter_output`, for a gateway's relay: it may start after chunk `after_seq` (a
    request placed again with the chunks already relayed restored), `lost()`, asked after every read,
    turns true when the request's lease vanished (-> OutputLost), and `expire_later(stream)`, when given,
    takes over the expiry after the final chunk (the gateway batches them: gateway.leases)."""
    cursor = _OutputCursor(request_id, shard, timeout_s, grace_s, entry, after_seq)
    while True:
        cursor.check_lease(lost)
        try:
            reply, kept = await xread(r, cursor.streams(), block_ms=block_ms, count=256), None
            if cursor.should_check(bool(reply)):
                kept = bool(await r.exists(cursor.stream)), bool(entry and await aentry_exists(r, *entry))
        except CONNECTION_ERRORS as e:
            await asyncio.sleep(cursor.failed(e))
            continue
        except redis.ResponseError as e:
            if wrong_type(e) and (found := await afind(r, cursor.names())):
                raise found[0] from e
            if cursor.type_changed(e):
                continue
            raise
        if kept:
            cursor.check_kept(*kept)
        for chunk in cursor.new_chunks(reply):
            yield chunk
            if chunk.final:
                if expire_later is not None:
                    expire_later(cursor.stream)
                    return
                with contextlib.suppress(*CONNECTION_ERRORS):
                    await r.pexpire(cursor.stream, int(expire_after_s * 1000))
                return


def output_exists(r: redis.Redis, request_id: str, shard: int = 0) -> bool:
    """The request's output stream is there (it expires a while after its final chunk was read)."""
    return bool(r.exists(keys.out_stream(request_id, shard)))


async def aentry_exists(r: aioredis.Redis, stream: str, entry_id: str) -> bool:
    """The request-stream entry is still there (queued, or pending on a worker): not acked yet."""
    return bool(await r.xrange(stream, entry_id, entry_id))


async def aentries_exist(r: aioredis.Redis, entries: Mapping[str, tuple[str, str]]) -> set[str]:
    """Of `entries` (a name -> its request-stream entry (stream, id)), the names whose entry is still there
    (queued, or pending on a worker: not acked). One round trip; the same shard's keys share a slot."""
    names = list(entries)
    if not names:
        return set()
    pipe = r.pipeline(transaction=False)
    for name in names:
        stream, entry_id = entries[name]
        pipe.xrange(stream, entry_id, entry_id)
    return {name for name, found in zip(names, await pipe.execute(), strict=True) if found}


async def aoutput_exists(r: aioredis.Redis, request_id: str, shard: int = 0) -> bool:
    return bool(await r.exists(keys.out_stream(request_id, shard)))


# ---- a gateway's inbox ----------------------------------------------------------------------------
# kvfleet:{s}:inbox:{gateway}, one per shard: each entry is one worker flush's chunks for that gateway's requests, a JSON array
# (shared.streams.flush._FLUSH). The gateway creates it and keeps its expiry; workers never create it.

_CHUNK_LIST = TypeAdapter(list[OutputChunk])
_OPENED = "opened"  # the field of the entry that creates an inbox (no chunks)


async def acreate_inbox(r: aioredis.Redis, inbox: str, ttl_s: float) -> None:
    """Create the inbox (an entry with no chunks) with its expiry; one round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.xadd(inbox, {_OPENED: "1"})
    pipe.pexpire(inbox, int(ttl_s * 1000))
    await pipe.execute()


async def adelete_inbox(r: aioredis.Redis, inbox: str) -> None:
    """The gateway stops: what workers still write for its requests is dropped (XADD NOMKSTREAM)."""
    await r.delete(inbox)


async def akeep_inbox(r: aioredis.Redis, inbox: str, read_up_to: str, ttl_s: float) -> bool:
    """Drop the entries before `read_up_to` (read already) and push the expiry out; False when the inbox is
    gone (Redis lost it): create it again. One round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.xtrim(inbox, minid=read_up_to, approximate=True)
    pipe.pexpire(inbox, int(ttl_s * 1000))
    return bool((await pipe.execute())[1])


async def aread_inbox(r: aioredis.Redis, inbox: str, after: str, *, block_ms: int, count: int = 1024
                      ) -> tuple[str, list[OutputChunk], list[tuple[str, str, str]]]:
    """The chunks of the entries after `after` (waiting up to block_ms for one), the moves among them (request
    id, stream, entry id: a worker put that request on another stream), and the new cursor. An entry that
    cannot be read is skipped (and logged)."""
    reply = await xread(r, {inbox: after}, block_ms=block_ms, count=count)
    chunks: list[OutputChunk] = []
    moves: list[tuple[str, str, str]] = []
    for _stream, entries in reply or []:
        for entry_id, raw_fields in entries:
            after = entry_id  # redis-py's client gives the fields as a dict, a Multiplexed one as RESP's list
            fields = raw_fields if isinstance(raw_fields, dict) else dict(zip(raw_fields[::2], raw_fields[1::2],
                                                                             strict=True))
            try:
                if (raw := fields.get(keys.FIELD)) is not None:
                    chunks += _CHUNK_LIST.validate_json(raw)
                elif (raw := fields.get(keys.MOVED_FIELD)) is not None:
                    request_id, stream, moved_to = json.loads(raw)
                    moves.append((str(request_id), str(stream), str(moved_to)))
            except (ValidationError, ValueError) as e:  # only a foreign writer makes one: skipped, blocks nobody
                log.error("skipping unreadable entry %s of %s: %s", entry_id, inbox, e)
    return after, chunks, moves
