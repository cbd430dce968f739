"""The worker side: its consumer-group reads, the claims of what dead workers left pending (who they are:
shared.streams.shard_members), the forward of a request its cache cannot hold, dead letters and cancels
(gpu_worker.serve.intake). Its writes of output, acks and status are shared.streams.flush.

The owner token of a stream entry (shared.streams.flush's fencing) is (consumer, delivery count) of the entry's
pending-list record: Redis sets both atomically with every XREADGROUP and XCLAIM here (each claim bumps the count),
so a worker that lost the entry to another (or to a later run under its own id) no longer matches."""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from shared.messages import DeadLetter, GenerationRequest
from shared.streams.client import LuaScript, run_script, wrong_type, xread, xreadgroup
from shared.streams.key_types import find, report
from shared.streams.requests import ENQUEUE_MARK_TTL_S, GUARD_LUA, call_nonce

log = logging.getLogger("kvfleet.streams")

# ---- worker side: intake --------------------------------------------------------------------------
# The worker's reader threads (gpu_worker.serve.intake): its consumer-group reads, the takeover of what dead
# workers left pending, dead letters, cancels.

DEAD_LETTER_MAXLEN = 10_000


CLAIM_PAGE = 100  # pending entries looked at per XPENDING/XCLAIM round trip


@dataclass(frozen=True)
class Ack:
    """A request-stream entry to acknowledge: XACK in the workers' group, then XDEL. With `deliveries` (the
    entry's delivery count when this worker got it) it is also the owner token: writes for the request are
    refused once the entry is no longer pending on this worker with that count; 0: not checked."""

    stream: str
    entry_id: str
    deliveries: int = 0


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
        return Ack(self.stream, self.entry_id, self.deliveries)


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
    reply = xreadgroup(r, keys.GROUP, consumer, want, count=count, block_ms=block_ms)
    return [Delivery(stream, entry_id, fields) for stream, entries in reply or [] for entry_id, fields in entries]


def shared_heads(r: redis.Redis, shard: int = 0, count: int = 1) -> list[dict[str, str]]:
    """The fields of the `count` oldest entries of the shard's shared stream that no worker has taken yet, oldest
    first ([]: none waits). An empty stream costs one XLEN, the common case of this poll (entries go when they are
    acked)."""
    if not r.xlen(keys.req_any(shard)):
        return []
    groups = {g["name"]: g for g in r.xinfo_groups(keys.req_any(shard))}
    last = groups.get(keys.GROUP, {}).get("last-delivered-id", "0-0")
    return [fields for _, fields in r.xrange(keys.req_any(shard), min=f"({last}", max="+", count=count)]


def claim_pending(r: redis.Redis, stream: str, owner: str, consumer: str, *, min_idle_ms: int,
                  skip: Container[str] = (), max_idle_ms: int | None = None) -> list[Delivery]:
    """Move to `consumer` every entry `owner` left pending on `stream` (but the ids in `skip`: those a claim that
    Redis broke off had already taken, and with `max_idle_ms` those delivered longer ago than that), CLAIM_PAGE at
    a time: XPENDING for that one consumer, then XCLAIM with
    `min_idle_ms`, so of two claimers only one gets each entry (XAUTOCLAIM by idle time alone would also take a
    live worker's long request). [] when the stream or group does not exist.
    Each Delivery's count is the one XCLAIM set (the one it saw plus one): its owner token. After each page
    that claimed something the owner's status is deleted (it had expired; an owner that came back meanwhile and
    wrote it again must not keep it): so the owner's flushes check ownership again and are refused
    (shared.streams.flush)."""
    claimed: list[Delivery] = []
    start = "-"
    while True:
        try:
            pending = r.xpending_range(stream, keys.GROUP, min=start, max="+", count=CLAIM_PAGE, consumername=owner)
        except redis.ResponseError:
            return claimed
        if not pending:
            return claimed
        counts = {p["message_id"]: p["times_delivered"] for p in pending if p["message_id"] not in skip
                  and (max_idle_ms is None or p["time_since_delivered"] <= max_idle_ms)}
        got = r.xclaim(stream, keys.GROUP, consumer, min_idle_ms, list(counts)) if counts else []
        if got and owner != consumer:  # the fence: the owner's next flush finds no status of its run
            r.delete(keys.status(owner, keys.stream_shard(stream)))
        for entry_id, fields in got:
            claimed.append(Delivery(stream, entry_id, fields or None, counts[entry_id] + 1))
        if len(pending) < CLAIM_PAGE:
            return claimed
        start = "(" + pending[-1]["message_id"]


def reclaim_own(r: redis.Redis, ack: Ack, consumer: str) -> Delivery | None:
    """The entry behind a refused write, claimed again by `consumer` if its pending record still names it with
    another delivery count (Redis came back from an AOF that lost the last claim): the new count is its owner
    token. None: another consumer owns it, or it is gone."""
    pending = r.xpending_range(ack.stream, keys.GROUP, min=ack.entry_id, max=ack.entry_id, count=1)
    if not pending or pending[0]["consumer"] != consumer:
        return None
    claimed = r.xclaim(ack.stream, keys.GROUP, consumer, 0, [ack.entry_id])
    if not claimed or not claimed[0][1]:
        return None
    return Delivery(ack.stream, ack.entry_id, claimed[0][1], pending[0]["times_delivered"] + 1)


def release_reservation(r: redis.Redis, worker_id: str, request_id: str, shard: int = 0) -> None:
    """Drop `worker_id`'s reservation of a request another worker took from its stream (it was taken for dead:
    should it be back, its next status will not count the request, and the reservation would hold its blocks
    until the hash expires)."""
    r.hdel(keys.reserved(worker_id, shard), request_id)


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


# Enqueue a request on another worker of the shard (reserving its blocks there), ack the entry it came in, and for a
# gateway's request tell its relay where it went (a `moved` entry in the gateway's inbox, KEYS[5]: NOMKSTREAM, as a
# gone gateway reads nothing), in one step; marked as the enqueues are (shared.streams.requests: the call's nonce
# and the new entry's id in the request's keys.enqueued, for a minute), so that the same call, sent again by
# redis-py after its reply was lost, enqueues nothing twice. KEYS: the target's reservations and stream, the
# entry's stream, the mark(, the inbox); ARGV: request id, blocks, the reservations' TTL (ms), the request's JSON,
# its field, the group, the entry id, the nonce, the mark's TTL (ms), the moved field.
_FORWARD = LuaScript(GUARD_LUA + """
local done = done_before(KEYS[4], ARGV[8])
if done then return done end
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
local entry = redis.call('XADD', KEYS[2], '*', ARGV[5], ARGV[4])
redis.call('XACK', KEYS[3], ARGV[6], ARGV[7])
redis.call('XDEL', KEYS[3], ARGV[7])
if KEYS[5] then
  redis.call('XADD', KEYS[5], 'NOMKSTREAM', '*', ARGV[10], cjson.encode({ARGV[1], KEYS[2], entry}))
end
redis.call('SET', KEYS[4], ARGV[8] .. ' ' .. entry, 'PX', ARGV[9])
return entry
""")


def forward(r: redis.Redis, request: GenerationRequest, worker_id: str, ack: Ack, shard: int = 0,
            *, reservation_ttl_s: float = 30.0) -> str:
    """Enqueue the request on another worker of the shard (reserving its blocks there) and ack this entry; for a
    gateway's request, tell its relay where it went (a `moved` entry in the gateway's inbox): one step
    (_FORWARD). -> the new entry's id."""
    rid = request.request_id
    names = [keys.reserved(worker_id, shard), keys.req_stream(worker_id, shard), ack.stream, keys.enqueued(rid, shard)]
    if request.reply_to:
        names.append(keys.inbox(request.reply_to, shard))
    return run_script(r, _FORWARD, names, [rid, request.kv_blocks, int(reservation_ttl_s * 1000),
                                           request.model_dump_json(), keys.FIELD, keys.GROUP, ack.entry_id,
                                           call_nonce(), int(ENQUEUE_MARK_TTL_S * 1000), keys.MOVED_FIELD])


# Append a dead letter (ARGV[2]) to kvfleet:dead unless it is among the last DEAD_LETTER_SEEN entries already: a
# write sent again (redis-py after a lost reply, or the worker's outbox after a failed flush) adds it once. A letter
# is unique (it carries its worker and time), and a resend comes within seconds, where dead letters are rare.
_DEAD_LETTER = LuaScript("""
for _, entry in ipairs(redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[4])) do
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == ARGV[1] and f[i + 1] == ARGV[2] then return entry[1] end
  end
end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', ARGV[1], ARGV[2])
""")
DEAD_LETTER_SEEN = 32


def dead_letter(r: redis.Redis, letter: DeadLetter) -> None:
    """Append to kvfleet:dead (capped, approximately, at DEAD_LETTER_MAXLEN), once however often it is sent
    (_DEAD_LETTER). A kvfleet:dead of another type (another program's write) takes no letter: that is logged, naming
    the key, once a minute, and the request's error goes to its client all the same (where the WRONGTYPE failed
    every flush of the worker's outbox)."""
    try:
        run_script(r, _DEAD_LETTER, [keys.DEAD], [keys.FIELD, letter.model_dump_json(), DEAD_LETTER_MAXLEN,
                                                  DEAD_LETTER_SEEN])
    except redis.ResponseError as e:
        if not wrong_type(e):
            raise
        report(find(r, [keys.DEAD]), f"worker {letter.worker_id}'s dead letters")


def cancel_cursor(r: redis.Redis) -> str:
    """Where a new reader of kvfleet:cancel starts: after the last cancel written so far."""
    return r.xinfo_stream(keys.CANCEL)["last-generated-id"] if r.exists(keys.CANCEL) else "0-0"


def read_cancels(r: redis.Redis, after: str, *, block_ms: int = 1000, count: int = 256) -> tuple[str, list[str]]:
    """The request ids cancelled after entry `after` (waiting up to block_ms for one), and the new cursor. An
    entry without one (a foreign writer's) is skipped and logged: it must not stop the reader on it."""
    ids = []
    for _stream, entries in xread(r, {keys.CANCEL: after}, block_ms=block_ms, count=count) or []:
        for entry_id, fields in entries:
            after = entry_id
            if isinstance(request_id := fields.get(keys.FIELD), str):
                ids.append(request_id)
            else:
                log.error("skipping unreadable entry %s of %s (no %r field): %s", entry_id, keys.CANCEL, keys.FIELD,
                          str(fields)[:200])
    return after, ids
