"""The request and output streams: the one place a request enters the fleet, output chunks are written,
and output is read back (with sequence-number dedup), for the gateway, the Celery tasks and the client.
Every Redis command kvfleet sends is here, as a named operation: besides the streams, the fleet reads (live
workers, reservations, the snapshot), the prefix index, job records, and the worker's intake and outbox.
Callers catch RedisError / CONNECTION_ERRORS from here; no other module imports redis.

Sync (`redis.Redis`) and asyncio (`redis.asyncio.Redis`) callers share the command builders; every client
is made by `connect` / `connect_async` with decode_responses=True, so `rediss://` and passwords in the URL
work the same everywhere.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import fleet_state, keys
from shared.fleet_state import FleetSnapshot, FleetView, StreamInfo
from shared.messages import DeadLetter, GenerationRequest, OutputChunk, WorkerStatus

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


# ---- errors callers catch -------------------------------------------------------------------------
# Modules outside this one catch these (and RedisError, below) instead of importing redis.

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError)  # Redis away or too slow: worth a retry


# ---- fleet reads ----------------------------------------------------------------------------------
# What the gateway routes on, and what GET /v1/fleet, `kvfleet status` / `top` and the gateway's fleet
# gauges show (shaped by shared.fleet_state). Read afresh for each request, so gateway replicas agree
# without talking to each other.

async def aping(r: aioredis.Redis) -> None:
    """Raises (a RedisError) unless Redis answers."""
    await r.ping()


async def aread_fleet(r: aioredis.Redis) -> FleetView:
    """Every worker ever seen: the live ones (status present) with the blocks reserved on them, the dead ones."""
    members = sorted(await r.smembers(keys.WORKERS))
    if not members:
        return FleetView()
    pipe = r.pipeline(transaction=False)
    for w in members:
        pipe.get(keys.status(w))
        pipe.hvals(keys.reserved(w))
    replies = await pipe.execute()
    view = FleetView()
    for w, raw, reserved in zip(members, replies[0::2], replies[1::2], strict=True):
        if raw is None:
            view.dead.append(w)
            continue
        view.live.append(WorkerStatus.model_validate_json(raw))
        view.reservations[w] = sum(int(v) for v in reserved)
    return view


async def _astream_info(r: aioredis.Redis, stream: str) -> StreamInfo:
    pipe = r.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xinfo_groups(stream)
    try:
        length, groups = await pipe.execute()
    except redis.ResponseError:  # no such stream
        return {"length": 0, "pending": 0}
    return {"length": length, "pending": sum(g.get("pending", 0) for g in groups)}


async def afleet_snapshot(r: aioredis.Redis) -> FleetSnapshot:
    """The fleet at a glance: workers, request streams with their pending counts, dead letters."""
    view = await aread_fleet(r)
    infos = {name: await _astream_info(r, name) for name in fleet_state.snapshot_streams(view)}
    return fleet_state.snapshot(view, infos, await r.xlen(keys.DEAD), time.time())


async def anext_turn(r: aioredis.Redis) -> int:
    """The next round-robin turn, counted in Redis so that gateway replicas share one rotation."""
    return await r.incr(keys.ROUND_ROBIN)


# ---- prefix index ---------------------------------------------------------------------------------
# The `prefix` routing policy's approximate view of each worker's prefix cache: the worker each prompt block
# (by its chained hash, shared.blocks.block_hashes) was last routed to, shared by gateway replicas, with a TTL.

PREFIX_TTL_S = 600


async def aprefix_owners(r: aioredis.Redis, hashes: list[str]) -> list[str | None]:
    """The worker each block was last routed to; None where none was (or its entry expired)."""
    return await r.mget([keys.prefix_block(h) for h in hashes]) if hashes else []


async def aremember_prefix(r: aioredis.Redis, hashes: list[str], worker_id: str, *,
                           ttl_s: float = PREFIX_TTL_S) -> None:
    """These blocks were just routed to `worker_id`."""
    pipe = r.pipeline(transaction=False)
    for h in hashes:
        pipe.set(keys.prefix_block(h), worker_id, ex=int(ttl_s))
    await pipe.execute()


# ---- job records ----------------------------------------------------------------------------------
# kvfleet:job:{request} as JSON text, and the fleet's streams searched for a request. services.job_record
# owns the protocol (the record's states and who may move it on); these are its atomic steps.

JOB_SCAN_PAGE = 500

# KEYS[1] record; ARGV: our placing record, now, lease seconds, ttl ms -> {1 fresh | 2 taken over | 0 held, old}
_CLAIM_JOB = LuaScript("""
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  if not (ok and rec.state == 'placing' and tonumber(ARGV[2]) - tonumber(rec.since) > tonumber(ARGV[3])) then
    return {0, cur}
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
if cur then return {2, cur} end
return {1, ''}
""")

# KEYS[1] record; ARGV: expected value, new value ('' deletes), ttl ms -> 1 replaced | 0 not ours any more
_REPLACE_JOB = LuaScript("""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
""")


async def aclaim_job(r: aioredis.Redis, request_id: str, lease: str, *, now: float, lease_s: float,
                     ttl_s: float) -> tuple[int, str]:
    """Write `lease` as the request's record unless one is there that is not a placing record older than
    `lease_s`, atomically: (1, "") the id was free, (2, old) a stale lease was taken over, (0, current) held."""
    outcome, old = await arun_script(r, _CLAIM_JOB, [keys.job(request_id)],
                                     [lease, now, lease_s, int(ttl_s * 1000)])
    return int(outcome), old


async def areplace_job(r: aioredis.Redis, request_id: str, expected: str, new: str, *, ttl_s: float = 0.0) -> bool:
    """Compare and set: the record becomes `new` ("" deletes it) only if it still is `expected`."""
    return bool(await arun_script(r, _REPLACE_JOB, [keys.job(request_id)], [expected, new, int(ttl_s * 1000)]))


async def aget_job(r: aioredis.Redis, request_id: str) -> str | None:
    return await r.get(keys.job(request_id))


async def afinish_job(r: aioredis.Redis, request_id: str, record: str, *, ttl_s: float,
                      output_ttl_s: float) -> None:
    """Store the finished record, and let the output stream expire in `output_ttl_s`, in one MULTI."""
    pipe = r.pipeline(transaction=True)
    pipe.set(keys.job(request_id), record, px=int(ttl_s * 1000))
    pipe.pexpire(keys.out_stream(request_id), int(output_ttl_s * 1000))
    await pipe.execute()


async def arequest_in_fleet(r: aioredis.Redis, request_id: str) -> bool:
    """Was the request enqueued? Its entry stays in a request stream until the worker writes its final chunk
    (the ack and XDEL go in the same MULTI as that chunk), so: look in the streams first, then for output."""
    names = [keys.REQ_ANY] + [keys.req_stream(w) for w in sorted(await r.smembers(keys.WORKERS))]
    for name in names:
        start = "-"
        while True:
            entries = await r.xrange(name, min=start, max="+", count=JOB_SCAN_PAGE)
            for _entry_id, fields in entries:
                if request_id in fields.get(keys.FIELD, "") and parse_request(fields).request_id == request_id:
                    return True
            if len(entries) < JOB_SCAN_PAGE:
                break
            start = "(" + entries[-1][0]
    return await aoutput_exists(r, request_id)


def output_exists(r: redis.Redis, request_id: str) -> bool:
    """The request's output stream is there (it expires a while after its final chunk was read)."""
    return bool(r.exists(keys.out_stream(request_id)))


async def aoutput_exists(r: aioredis.Redis, request_id: str) -> bool:
    return bool(await r.exists(keys.out_stream(request_id)))


# ---- worker side: intake --------------------------------------------------------------------------
# The worker's reader threads (gpu_worker.serve.intake): its consumer-group reads, the takeover of what dead
# workers left pending, dead letters, cancels.

Client = redis.Redis  # what `connect` returns: the worker's threads share one
RedisError = redis.RedisError  # any failed command: the worker's threads log it and try again
DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True)
class Ack:
    """A request-stream entry to acknowledge: XACK in the workers' group, then XDEL."""

    stream: str
    entry_id: str


@dataclass(frozen=True)
class Delivery:
    """One request-stream entry as this consumer received it. `fields` is None when the entry was deleted
    after it was delivered; `deliveries` counts this delivery too."""

    stream: str
    entry_id: str
    fields: dict[str, str] | None
    deliveries: int = 1

    @property
    def ack(self) -> Ack:
        return Ack(self.stream, self.entry_id)


def ensure_group(r: redis.Redis, stream: str) -> None:
    """Create the workers' consumer group on `stream` (and the stream), unless it exists."""
    try:
        r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def read_requests(r: redis.Redis, consumer: str, want: dict[str, str], *, count: int,
                  block_ms: int | None = None) -> list[Delivery]:
    """XREADGROUP as `consumer` from each stream in `want` (stream -> id, ">" for new entries)."""
    reply = r.xreadgroup(keys.GROUP, consumer, want, count=count, block=block_ms)
    return [Delivery(stream, entry_id, fields) for stream, entries in reply or [] for entry_id, fields in entries]


def shared_head(r: redis.Redis) -> dict[str, str] | None:
    """The fields of the oldest entry of kvfleet:req:any that no worker has taken yet (None: none waits)."""
    groups = {g["name"]: g for g in r.xinfo_groups(keys.REQ_ANY)}
    last = groups.get(keys.GROUP, {}).get("last-delivered-id", "0-0")
    head = r.xrange(keys.REQ_ANY, min=f"({last}", max="+", count=1)
    return head[0][1] if head else None


def claim_pending(r: redis.Redis, stream: str, owner: str, consumer: str, *, min_idle_ms: int,
                  count: int) -> list[Delivery]:
    """Move to `consumer` up to `count` entries `owner` left pending on `stream`: XPENDING for that one
    consumer, then XCLAIM with `min_idle_ms`, so of two claimers only one gets each entry (XAUTOCLAIM by idle
    time alone would also take a live worker's long request). [] when the stream or group does not exist."""
    try:
        pending = r.xpending_range(stream, keys.GROUP, min="-", max="+", count=count, consumername=owner)
    except redis.ResponseError:
        return []
    if not pending:
        return []
    counts = {p["message_id"]: p["times_delivered"] for p in pending}
    claimed = r.xclaim(stream, keys.GROUP, consumer, min_idle_ms, list(counts))
    return [Delivery(stream, entry_id, fields or None, counts[entry_id] + 1) for entry_id, fields in claimed]


def other_workers(r: redis.Redis, worker_id: str) -> dict[str, WorkerStatus | None]:
    """Every other worker ever seen (kvfleet:workers), by id, with its status: None when the status expired
    (the worker is dead)."""
    members = sorted(r.smembers(keys.WORKERS) - {worker_id})
    raw = r.mget([keys.status(w) for w in members]) if members else []
    return {w: None if s is None else WorkerStatus.model_validate_json(s) for w, s in zip(members, raw, strict=True)}


def prune_dead_worker(r: redis.Redis, dead: str) -> bool:
    """Forget a dead worker that left nothing behind (its own stream empty, nothing of kvfleet:req:any
    pending on it): delete its stream and reservations, drop it from kvfleet:workers and from the shared
    stream's group, in one MULTI. False: it still has requests to take over."""
    if r.xlen(keys.req_stream(dead)) or r.xpending_range(keys.REQ_ANY, keys.GROUP, "-", "+", 1, consumername=dead):
        return False
    pipe = r.pipeline(transaction=True)
    pipe.delete(keys.req_stream(dead), keys.reserved(dead))
    pipe.srem(keys.WORKERS, dead)
    pipe.xgroup_delconsumer(keys.REQ_ANY, keys.GROUP, dead)
    pipe.execute()
    return True


def is_cancelled(r: redis.Redis, request_id: str) -> bool:
    """A cancel for the request was written (the marker outlives the kvfleet:cancel entry a reader missed)."""
    return bool(r.exists(keys.cancelled(request_id)))


def ack_commands(pipe: Any, ack: Ack) -> None:
    pipe.xack(ack.stream, keys.GROUP, ack.entry_id)
    pipe.xdel(ack.stream, ack.entry_id)


def ack_and_delete(r: redis.Redis, ack: Ack) -> None:
    """XACK and XDEL the entry, in one MULTI."""
    pipe = r.pipeline(transaction=True)
    ack_commands(pipe, ack)
    pipe.execute()


def forward(r: redis.Redis, request: GenerationRequest, worker_id: str, ack: Ack) -> None:
    """Enqueue the request on another worker (reserving its blocks there) and ack this entry, in one MULTI."""
    pipe = r.pipeline(transaction=True)
    enqueue_commands(pipe, request, worker_id)
    ack_commands(pipe, ack)
    pipe.execute()


def dead_letter(r: redis.Redis, letter: DeadLetter) -> None:
    """Append to kvfleet:dead (capped, approximately, at DEAD_LETTER_MAXLEN)."""
    r.xadd(keys.DEAD, {keys.FIELD: letter.model_dump_json()}, maxlen=DEAD_LETTER_MAXLEN, approximate=True)


def cancel_cursor(r: redis.Redis) -> str:
    """Where a new reader of kvfleet:cancel starts: after the last cancel written so far."""
    return r.xinfo_stream(keys.CANCEL)["last-generated-id"] if r.exists(keys.CANCEL) else "0-0"


def read_cancels(r: redis.Redis, after: str, *, block_ms: int = 1000, count: int = 256) -> tuple[str, list[str]]:
    """The request ids cancelled after entry `after` (waiting up to block_ms for one), and the new cursor."""
    ids = []
    for _stream, entries in r.xread({keys.CANCEL: after}, block=block_ms, count=count) or []:
        for entry_id, fields in entries:
            after = entry_id
            ids.append(fields[keys.FIELD])
    return after, ids


# ---- worker side: outbox --------------------------------------------------------------------------
# The worker's writer thread (gpu_worker.serve.outbox): everything it writes goes in one MULTI per flush.

def publish(r: redis.Redis, worker_id: str, *, output_ttl_s: float, chunks: Sequence[OutputChunk] = (),
            requeued: Sequence[GenerationRequest] = (), acks: Sequence[Ack] = (),
            status: WorkerStatus | None = None, status_ttl_s: float = 0.0, taken: Sequence[str] = ()) -> None:
    """One MULTI, in this order: the output chunks (XADD + expiry), the hand-backs (XADD to kvfleet:req:any),
    the acks (XACK + XDEL, so an entry is acked only with or after the chunks before it), and with `status`
    its SET with a TTL of status_ttl_s, the worker's SADD to kvfleet:workers and the HDEL of the
    reservations of the `taken` requests, which that status now counts."""
    pipe = r.pipeline(transaction=True)
    for chunk in chunks:
        add_chunk_commands(pipe, chunk, output_ttl_s)
    for request in requeued:
        enqueue_commands(pipe, request, None)
    for ack in acks:
        ack_commands(pipe, ack)
    if status is not None:
        pipe.set(keys.status(worker_id), status.model_dump_json(), px=int(status_ttl_s * 1000))
        pipe.sadd(keys.WORKERS, worker_id)
        if taken:
            pipe.hdel(keys.reserved(worker_id), *taken)
    pipe.execute()


def remove_status(r: redis.Redis, worker_id: str) -> None:
    """Delete the worker's status: to the others it is dead at once, and they take over what it left."""
    r.delete(keys.status(worker_id))
