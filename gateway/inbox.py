"""One gateway's output inboxes (kvfleet:{s}:inbox:{gateway}, one per shard, shared.streams): the workers of a
shard write each flush's chunks for this gateway's requests as one entry (GenerationRequest.reply_to), and one
reader task per shard here reads them all, one blocking XREAD per flush however many requests are running (not
one read per request), and hands each chunk to its request's mailbox, which that request's relay drains.

A mailbox is opened before its request is enqueued (so no chunk can come before it) and closed when the relay
ends; a chunk for a request without one (its relay ended, or it was placed again under another id) is
dropped. Once a second the reader trims what it read and pushes the inbox's expiry out: the inbox of a gateway
that died expires, and workers never create one (XADD NOMKSTREAM). When Redis comes back without the inbox
the reader creates it again; the requests whose chunks were lost meanwhile are found by their leases
(gateway.leases) or by a gap in their chunk numbers, and their relays place them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from shared import keys, streams
from shared.messages import OutputChunk
from shared.outage_log import OutageLog

log = logging.getLogger("kvfleet.gateway")

KEEP_EVERY_S = 1.0  # trim and push the expiry out this often
TICK_S = 1.0  # a waiting relay checks its lease, its deadline and Redis's absence this often
SILENCE_CHECK_S = 10.0  # ... and after this long without a chunk, that its request entry is still there


def gateway_id() -> str:
    """This gateway process's id (its inbox's name): host, pid and a random part, unique across restarts."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class WorkerLost(Exception):
    """The worker running the request died; the one that took its entry over handed it back to this gateway
    (a `worker_lost` chunk): place it again with the chunks relayed so far."""


class Mailbox:
    """The chunks that came for one request and are not relayed yet, and the relay waiting for them."""

    def __init__(self) -> None:
        self.items: deque[OutputChunk] = deque()
        self.dedup = streams.ChunkDeduper()
        self.waiter: asyncio.Future | None = None
        self.entry: tuple[str, str] | None = None  # (stream, entry id) where its request waits or runs

    def put(self, chunk: OutputChunk) -> None:
        self.items.append(chunk)
        if self.waiter is not None:
            _wake(self.waiter)

    async def wait(self, timeout_s: float) -> None:
        """Until a chunk is here, or timeout_s passed."""
        if self.items:
            return
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _wake, waiter)  # (not asyncio.timeout: its cancel machinery costs more)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None


def gather(chunk: OutputChunk, box: Mailbox) -> OutputChunk:
    """`chunk` with the chunks of the same choice that wait right behind it merged in (their tokens, text and
    logprobs; the last one's sequence number, end and usage), taken from the mailbox: a relay that fell behind
    its worker (a busy gateway) sends what piled up in one event, one write, instead of one per token, so
    the busier the gateway, the less it spends per token. One that keeps up sends each chunk as it comes."""
    items, last = box.items, chunk
    if (not items or chunk.final or chunk.finish_reason is not None or chunk.error is not None
            or chunk.prompt_logprobs is not None):
        return chunk
    token_ids, texts, logprobs = list(chunk.token_ids), [chunk.text], chunk.logprobs
    while items:
        nxt = items[0]
        if (nxt.seq != last.seq + 1 or nxt.index != chunk.index or nxt.error is not None
                or nxt.owner_token() != chunk.owner_token() or (nxt.logprobs is None) != (logprobs is None)
                or nxt.prompt_logprobs is not None):
            break  # anything else takes the usual path: checks, dedup, an event of its own
        items.popleft()
        box.dedup.accept_next(nxt)  # the next sequence number from the same owner: accepted
        token_ids += nxt.token_ids
        texts.append(nxt.text)
        if logprobs is not None and nxt.logprobs is not None:
            logprobs = logprobs + nxt.logprobs
        last = nxt
        if nxt.final or nxt.finish_reason is not None:
            break
    if last is chunk:
        return chunk
    return last.model_copy(update={"token_ids": token_ids, "text": "".join(texts), "logprobs": logprobs})


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _ShardInbox:
    """Where the reader of one shard's inbox stands."""

    def __init__(self, key: str, reader: Any):
        self.key, self.cursor = key, "0-0"
        self.reader = reader  # the client its blocking read waits on
        # its reads' failures: `outage.since`, the monotonic time they began (None while they go through)
        self.outage = OutageLog(log, f"reading the output inbox {key}")
        self.foreign: streams.KeyOfAnotherType | None = None  # its key holds another type (another program's write)
        self.task: asyncio.Task | None = None


class Inbox:
    """The gateway's inboxes, one per shard its requests went to (shared.keys), each with its reader task:
    on Redis Cluster each shard's blocking read waits on its own connection to its own master. `reader()`, when
    given, makes the client each shard's reads go through (a shared.streams.Multiplexed of its own: one read
    per flush costs a tenth of redis-py's CPU); the rest goes through `r`."""

    def __init__(self, r: Any, gateway_id: str, *, ttl_s: float, block_ms: int = 1000,
                 reader: Callable[[], Any] | None = None):
        self.r, self.gateway_id, self.ttl_s, self.block_ms = r, gateway_id, ttl_s, block_ms
        self.reader = reader
        self.boxes: dict[str, Mailbox] = {}
        self.shards: dict[int, _ShardInbox] = {}
        self.dropped = 0  # chunks for requests with no mailbox
        self._closing = False

    async def start(self) -> None:
        """Create shard 0's inbox and start reading it (the others once a request goes there). Redis away: the
        reader creates it once it is back."""
        await self.read_shard(0)

    async def read_shard(self, shard: int) -> None:
        """Make sure shard's inbox exists and is read (before a request is enqueued there). Its key of another type
        (another program's write: no output could come back) raises KeyOfAnotherType, a 503 that names it."""
        if shard in self.shards:
            if (foreign := self.shards[shard].foreign) is not None:
                raise foreign
            return
        inbox = self.shards[shard] = _ShardInbox(keys.inbox(self.gateway_id, shard),
                                                 self.r if self.reader is None else self.reader())
        try:
            await streams.acreate_inbox(self.r, inbox.key, self.ttl_s)
        except streams.RedisError as e:
            log.warning("could not create the output inbox %s yet: %s", inbox.key, e)
        inbox.task = asyncio.get_running_loop().create_task(self._read(inbox))

    async def close(self) -> None:
        self._closing = True  # redis-py may turn the cancel of a blocking read into a ConnectionError
        tasks = [inbox.task for inbox in self.shards.values() if inbox.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for inbox in self.shards.values():
            with contextlib.suppress(streams.RedisError):
                await streams.adelete_inbox(self.r, inbox.key)
            if inbox.reader is not self.r:
                await inbox.reader.aclose()

    def open(self, request_id: str) -> None:
        """Collect the request's chunks from now on (call before it is enqueued)."""
        self.boxes[request_id] = Mailbox()

    def close_box(self, request_id: str) -> None:
        self.boxes.pop(request_id, None)

    async def chunks(self, request_id: str, *, timeout_s: float, grace_s: float,
                     lost: Callable[[], bool] | None = None, after_seq: int = -1,
                     entry: tuple[str, str] | None = None,
                     stranded: Callable[[int], Awaitable[bool]] | None = None) -> AsyncIterator[OutputChunk]:
        """The request's chunks in order, each once, after chunk `after_seq` (those a request placed again
        had relayed already, and were restored for its worker) until its final one. OutputTimeout when none comes for
        timeout_s, RedisAway when the inbox could not be read for grace_s, OutputLost when `lost()` (its lease
        vanished) or a chunk number was skipped (Redis lost chunks), or when after SILENCE_CHECK_S without a
        chunk its request `entry` (stream, id) is gone, acked, with no final chunk here (one dropped on its way),
        WorkerLost when its worker died, or when after SILENCE_CHECK_S without a chunk `stranded(shard)` says no
        live worker is left in its shard to run it (while other shards have some)."""
        box = self.boxes.get(request_id)
        if box is None:
            raise RuntimeError(f"no mailbox open for request {request_id}")
        box.dedup.last_seq = max(box.dedup.last_seq, after_seq)
        box.entry = box.entry or entry
        shard_id = keys.stream_shard(box.entry[0]) if box.entry else 0
        shard = self.shards.get(shard_id)
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + SILENCE_CHECK_S
        while True:
            while box.items:
                chunk = box.items.popleft()
                if chunk.error is not None and chunk.error.kind == "worker_lost":
                    raise WorkerLost(chunk.error.message)
                if box.dedup.accept_next(chunk):
                    deadline, next_check = time.monotonic() + timeout_s, time.monotonic() + SILENCE_CHECK_S
                    chunk = gather(chunk, box)
                    yield chunk
                    if chunk.final:
                        return
            if lost is not None and lost():
                # its lease and its entry were gone: Redis lost it, or it just ended (its lease lapsed while Redis
                # refused writes, say), and its last chunks, written with its ack, are on their way here
                await box.wait(TICK_S)
                if box.items:
                    continue
                raise streams.OutputLost(f"Redis lost request {request_id}: its lease vanished (Redis restarted "
                                         "without its data or was flushed, or the gateway stalled past the lease TTL)")
            now = time.monotonic()
            down_since = shard.outage.since if shard is not None else None
            if down_since is not None and now - down_since >= grace_s and not await self._answers():
                raise streams.RedisAway(f"lost the connection to Redis for more than {grace_s:g}s (redis_grace_s) "
                                        f"while reading the output of request {request_id}; retry the request once "
                                        "Redis is back")
            if now >= deadline:
                raise streams.OutputTimeout(f"no output for request {request_id} in {timeout_s:g}s")
            if box.entry is not None and now >= next_check and down_since is None:
                next_check = now + SILENCE_CHECK_S
                if stranded is not None and not box.items and await stranded(shard_id):
                    raise WorkerLost(f"no live worker is left in shard {shard_id} to run request {request_id}")
                if not await self._entry_alive(box.entry) and not box.items:
                    await box.wait(TICK_S)  # its last chunks may be on their way
                    if not box.items:
                        raise streams.OutputLost(f"request {request_id} was acked, but its final chunk never came "
                                                 "(written while this gateway's inbox was missing?)")
                continue
            await box.wait(min(TICK_S, deadline - now))

    async def _answers(self) -> bool:
        """Does Redis answer now? Its inbox reader can still be in its back-off (up to 1 s) from an outage that
        just ended, while a request placed since then waits for output: that request is not Redis's loss."""
        try:
            await streams.aping(self.r)
            return True
        except streams.RedisError:
            return False

    async def _entry_alive(self, entry: tuple[str, str]) -> bool:
        try:
            return await streams.aentry_exists(self.r, *entry)
        except streams.RedisError:
            return True  # unknown: the outage is handled on its own

    async def ensure(self) -> None:
        """Trim what was read, push the expiry out, and create an inbox again if Redis lost it, in every shard
        (before a request is placed again: its chunks must not find the inbox missing)."""
        for inbox in list(self.shards.values()):
            await self._keep(inbox)

    async def _keep(self, inbox: _ShardInbox) -> None:
        if not await streams.akeep_inbox(self.r, inbox.key, inbox.cursor, self.ttl_s):
            log.warning("the output inbox %s was gone (Redis lost its data?): creating it again", inbox.key)
            await streams.acreate_inbox(self.r, inbox.key, self.ttl_s)

    async def _read(self, inbox: _ShardInbox) -> None:
        failures, next_keep = 0, time.monotonic() + KEEP_EVERY_S
        while not self._closing:
            try:
                if time.monotonic() >= next_keep:
                    next_keep = time.monotonic() + KEEP_EVERY_S
                    await self._keep(inbox)
                inbox.cursor, chunks, moves = await streams.aread_inbox(inbox.reader, inbox.key, inbox.cursor,
                                                                        block_ms=self.block_ms)
                failures, inbox.foreign = 0, None
                inbox.outage.ok()
            except streams.RedisError as e:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # redis-py turned a cancel into a ConnectionError
                    raise asyncio.CancelledError from e
                if streams.wrong_type(e) and (found := await streams.afind(self.r, [inbox.key])):
                    inbox.foreign, next_keep = found[0], 0.0  # requests get a 503 naming it until it is gone
                    streams.report(found, f"gateway {self.gateway_id}'s output inbox reader")
                    await asyncio.sleep(1.0)
                    continue
                failures, next_keep = failures + 1, 0.0  # once back, check at once that Redis kept the inbox
                wait = min(0.05 * 2 ** (failures - 1), 1.0)
                inbox.outage.failed(e, "retrying, backing off to 1 s apart")
                await asyncio.sleep(wait)
                continue
            except Exception:  # noqa: BLE001 (the reader must not die: every relay waits on it)
                log.exception("unexpected error in the output inbox reader; carrying on")
                await asyncio.sleep(0.1)
                continue
            for request_id, stream, entry_id in moves:  # a worker handed it back or forwarded it
                if (moved := self.boxes.get(request_id)) is not None:
                    moved.entry = (stream, entry_id)
            for chunk in chunks:
                box = self.boxes.get(chunk.request_id)
                if box is None:
                    self.dropped += 1
                else:
                    box.put(chunk)
