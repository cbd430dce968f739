"""The worker side: its consumer-group reads, takeover of what dead workers left pending, dead letters and
cancels (gpu_worker.serve.intake), and one Lua script per flush of chunks, hand-backs, acks and status
(gpu_worker.serve.outbox).

Fencing: a worker writes a request's chunks, hand-back and ack only while it owns the stream entry. The owner
token is (consumer, delivery count) of the entry's pending-list record: Redis sets both atomically with every
XREADGROUP and XCLAIM (each claim bumps the count), so a worker that lost the entry to another (or to a
later run under its own id) no longer matches, with no owner key to set at claim time or to expire. The
flush script checks ownership (XPENDING of each entry) only when the worker's status in Redis is not its run's:
a takeover needs the owner's status gone, and the taker deletes it again after claiming, so while the status
stays the run's nobody took anything (one GET per flush instead of one XPENDING per request per flush); when it
is not, every request the worker holds is checked before the status it writes re-arms the fence."""

from __future__ import annotations

import json
import logging
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from shared import keys
from shared.fleet_state import UnreadableStatus, parse_status
from shared.messages import DeadLetter, GenerationRequest, OutputChunk, WorkerStatus
from shared.streams.client import LuaScript, group_missing, run_script, xread, xreadgroup
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


def shared_head(r: redis.Redis, shard: int = 0) -> dict[str, str] | None:
    """The fields of the oldest entry of the shard's shared stream that no worker has taken yet (None: none
    waits). An empty stream costs one XLEN, the common case of this poll (entries go when they are acked)."""
    if not r.xlen(keys.req_any(shard)):
        return None
    groups = {g["name"]: g for g in r.xinfo_groups(keys.req_any(shard))}
    last = groups.get(keys.GROUP, {}).get("last-delivered-id", "0-0")
    head = r.xrange(keys.req_any(shard), min=f"({last}", max="+", count=1)
    return head[0][1] if head else None


def claim_pending(r: redis.Redis, stream: str, owner: str, consumer: str, *, min_idle_ms: int,
                  skip: Container[str] = (), max_idle_ms: int | None = None) -> list[Delivery]:
    """Move to `consumer` every entry `owner` left pending on `stream` (but the ids in `skip`: those a claim that
    Redis broke off had already taken, and with `max_idle_ms` those delivered longer ago than that), CLAIM_PAGE at
    a time: XPENDING for that one consumer, then XCLAIM with
    `min_idle_ms`, so of two claimers only one gets each entry (XAUTOCLAIM by idle time alone would also take a
    live worker's long request). [] when the stream or group does not exist.
    Each Delivery's count is the one XCLAIM set (the one it saw plus one): its owner token. After each page
    that claimed something the owner's status is deleted (it had expired; an owner that came back meanwhile and
    wrote it again must not keep it): so the owner's flushes check ownership again and are refused (_FLUSH)."""
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


def register_shard(r: redis.Redis, shard: int) -> None:
    """A worker lives in `shard`: the fleet reads (aread_fleet) look there from now on."""
    r.sadd(keys.SHARDS, shard)


def request_streams(r: redis.Redis, shard: int = 0) -> list[str]:
    """Every stream of the shard an entry may be pending on for any worker: the shared stream and each known
    worker's own (a worker also reads new entries on the streams of workers it takes for dead, as itself: such an
    entry stays pending on it there)."""
    return [keys.req_any(shard)] + [keys.req_stream(w, shard) for w in sorted(r.smembers(keys.workers(shard)))]


def pending_owners(r: redis.Redis, streams: Sequence[str]) -> dict[str, set[str]]:
    """For each of `streams` (one shard's: one slot, one round trip), the consumers that hold pending entries on
    it: one XPENDING summary a stream, so a takeover scan costs one command per stream however many workers
    are dead. A stream or group that does not exist holds none."""
    pipe = r.pipeline(transaction=False)
    for stream in streams:
        pipe.xpending(stream, keys.GROUP)
    owners: dict[str, set[str]] = {}
    for stream, summary in zip(streams, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(summary, Exception):
            if group_missing(summary):
                continue
            raise summary
        owners[stream] = {c["name"] for c in summary.get("consumers") or [] if int(c["pending"])}
    return owners


def release_reservation(r: redis.Redis, worker_id: str, request_id: str, shard: int = 0) -> None:
    """Drop `worker_id`'s reservation of a request another worker took from its stream (it was taken for dead:
    should it be back, its next status will not count the request, and the reservation would hold its blocks
    until the hash expires)."""
    r.hdel(keys.reserved(worker_id, shard), request_id)


def other_workers(r: redis.Redis, worker_id: str, shard: int = 0) -> dict[str, WorkerStatus | None]:
    """Every other worker of the shard ever seen, by id, with its status: None when the status expired (the
    worker is dead). One whose status this version cannot read is left out (shared.fleet_state.parse_status).
    One MGET: the statuses share the shard's slot."""
    members = sorted(r.smembers(keys.workers(shard)) - {worker_id})
    raw = r.mget([keys.status(w, shard) for w in members]) if members else []
    others: dict[str, WorkerStatus | None] = {}
    for w, s in zip(members, raw, strict=True):
        try:
            others[w] = None if s is None else parse_status(w, s)
        except UnreadableStatus:
            pass
    return others


# Forget a dead worker, in one step: only if its status is still gone, its stream empty and nothing pending on
# it in any other stream of the shard (KEYS[5...]: the shared one, the other workers' own); a gateway's XADD or a
# restart between a check and the delete is never lost.
_PRUNE_DEAD = LuaScript("""
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('XLEN', KEYS[2]) > 0 then return 0 end
for i = 5, #KEYS do
  local pending = redis.pcall('XPENDING', KEYS[i], ARGV[1], '-', '+', 1, ARGV[2])
  if type(pending) == 'table' and pending['err'] == nil and #pending > 0 then return 0 end
end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SREM', KEYS[4], ARGV[2])
for i = 5, #KEYS do redis.pcall('XGROUP', 'DELCONSUMER', KEYS[i], ARGV[1], ARGV[2]) end
return 1
""")


def prune_dead_worker(r: redis.Redis, dead: str, shard: int = 0, shard_streams: Sequence[str] | None = None) -> bool:
    """Forget a dead worker of the shard that left nothing behind (no status, its own stream empty, nothing
    pending on it in the shard's other streams: `request_streams`, read here unless the caller just did): delete
    its stream and reservations, drop it from the shard's workers and from the other streams' groups,
    atomically. False: it still has requests to take over (or came back)."""
    if shard_streams is None:
        shard_streams = request_streams(r, shard)
    others = [s for s in shard_streams if s != keys.req_stream(dead, shard)]
    return bool(run_script(r, _PRUNE_DEAD, [keys.status(dead, shard), keys.req_stream(dead, shard),
                                            keys.reserved(dead, shard), keys.workers(shard), *others],
                           [keys.GROUP, dead]))


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


# Enqueue a request on another worker of the shard (reserving its blocks there) and ack the entry it came in, in one
# step; marked as the enqueues are (shared.streams.requests: the call's nonce and the new entry's id in the request's
# keys.enqueued, for a minute), so that the same call, sent again by redis-py after its reply was lost, enqueues
# nothing twice. KEYS: the target's reservations and stream, the entry's stream, the mark; ARGV: request id, blocks,
# the reservations' TTL (ms), the request's JSON, its field, the group, the entry id, the nonce, the mark's TTL (ms).
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
redis.call('SET', KEYS[4], ARGV[8] .. ' ' .. entry, 'PX', ARGV[9])
return entry
""")


def forward(r: redis.Redis, request: GenerationRequest, worker_id: str, ack: Ack, shard: int = 0,
            *, reservation_ttl_s: float = 30.0) -> str:
    """Enqueue the request on another worker of the shard (reserving its blocks there) and ack this entry, in
    one step (_FORWARD); then, for a gateway's request, tell its relay where it went (a `moved` entry in the
    gateway's inbox). -> the new entry's id."""
    rid = request.request_id
    entry_id = run_script(r, _FORWARD, [keys.reserved(worker_id, shard), keys.req_stream(worker_id, shard),
                                        ack.stream, keys.enqueued(rid, shard)],
                          [rid, request.kv_blocks, int(reservation_ttl_s * 1000), request.model_dump_json(),
                           keys.FIELD, keys.GROUP, ack.entry_id, call_nonce(), int(ENQUEUE_MARK_TTL_S * 1000)])
    if request.reply_to:
        moved = json.dumps([rid, keys.req_stream(worker_id, shard), entry_id])
        r.xadd(keys.inbox(request.reply_to, shard), {keys.MOVED_FIELD: moved}, nomkstream=True)
    return entry_id


def dead_letter(r: redis.Redis, letter: DeadLetter) -> None:
    """Append to kvfleet:dead (capped, approximately, at DEAD_LETTER_MAXLEN)."""
    r.xadd(keys.DEAD, {keys.FIELD: letter.model_dump_json()}, maxlen=DEAD_LETTER_MAXLEN, approximate=True)


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


# ---- worker side: outbox --------------------------------------------------------------------------
# The worker's writer thread (gpu_worker.serve.outbox): everything it writes goes in one script per flush.

# One flush of the outbox, atomically. ARGV[1] is the plan (JSON; every key it names is an index into KEYS,
# every message body an index into ARGV, so no chunk is JSON inside JSON), ARGV[2] the worker id, ARGV[3] its
# run id, ARGV[4...] the chunks' and requests' JSON:
#   fence    the worker's status key: when it holds this run's status (GET, or SET ... GET with `status`), no
#            other worker can have taken over its entries (a takeover needs the status gone, and the taker
#            deletes it again after claiming), so chunk writes skip their ownership check
#   owners   [stream, entry id, deliveries]: the deliveries the writes below are made under, and every
#            other one the worker holds (`held`); deliveries 0 is not checked, else the entry must be pending
#            on ARGV[2] with exactly that delivery count: checked when the fence failed (then all of them
#            are, before the status written here re-arms it)
#   chunks   [owner (0: none), output stream, chunk, expire (0/1)]: XADD, and PEXPIRE by `ttl` when
#            `expire` (a stream's first chunk, every EXPIRE_EVERY-th and its last: not one PEXPIRE per token)
#   inboxes  [inbox, [[owner, chunk]...]]: one XADD per gateway inbox of all its owned chunks (a JSON
#            array), NOMKSTREAM: a gateway that is gone reads nothing, so nothing is written
#   requeued [owner, request(, inbox, request id)]: XADD to `any` (the hand-back), then the ack of the owner's
#     entry; for a gateway's request, a `moved` entry in its inbox naming the new entry
#   acks     [owner]: XACK + XDEL of the owner's entry
#   status   [status, ttl ms, workers set, reservations hash, taken request ids...] or absent; SADD to the
#            workers set only when the fence failed (a first flush, or after the status was lost)
# Writes under an owner that fails its check are skipped; the reply lists those owners (1-based).
_FLUSH = LuaScript("""
local plan = cjson.decode(ARGV[1])
local group, field = plan['group'], plan['field']
local s = plan['status']
local before
if s then
  before = redis.call('SET', KEYS[plan['fence']], ARGV[s[1]], 'PX', s[2], 'GET')
else
  before = redis.call('GET', KEYS[plan['fence']])
end
local trusted = ARGV[3] ~= '' and type(before) == 'string' and string.find(before, ARGV[3], 1, true) ~= nil
local owned, refused = {}, {}
for i, o in ipairs(plan['owners']) do
  local ok = o[3] == 0 or trusted
  if not ok then
    local p = redis.pcall('XPENDING', KEYS[o[1]], group, o[2], o[2], 1)
    ok = type(p) == 'table' and p['err'] == nil and p[1] ~= nil and p[1][2] == ARGV[2] and p[1][4] == o[3]
  end
  owned[i] = ok
  if not ok then refused[#refused + 1] = i end
end
local function ack(o)
  redis.call('XACK', KEYS[o[1]], group, o[2])
  redis.call('XDEL', KEYS[o[1]], o[2])
end
for _, c in ipairs(plan['chunks']) do
  if c[1] == 0 or owned[c[1]] then
    redis.call('XADD', KEYS[c[2]], '*', field, ARGV[c[3]])
    if c[4] == 1 then redis.call('PEXPIRE', KEYS[c[2]], plan['ttl']) end
  end
end
for _, box in ipairs(plan['inboxes']) do
  local parts = {}
  for _, c in ipairs(box[2]) do
    if c[1] == 0 or owned[c[1]] then parts[#parts + 1] = ARGV[c[2]] end
  end
  if #parts > 0 then
    redis.call('XADD', KEYS[box[1]], 'NOMKSTREAM', '*', field, '[' .. table.concat(parts, ',') .. ']')
  end
end
for _, q in ipairs(plan['requeued']) do
  local o = plan['owners'][q[1]]
  -- the ack first: 0 when the entry was no longer pending (this flush ran already, its reply lost, and it was
  -- sent again): the hand-back is not made twice
  if owned[q[1]] and redis.call('XACK', KEYS[o[1]], group, o[2]) == 1 then
    redis.call('XDEL', KEYS[o[1]], o[2])
    local id = redis.call('XADD', KEYS[plan['any']], '*', field, ARGV[q[2]])
    if q[3] then  -- a gateway's request: where it is now, for its relay's silence check
      redis.call('XADD', KEYS[q[3]], 'NOMKSTREAM', '*', plan['moved'], cjson.encode({q[4], KEYS[plan['any']], id}))
    end
  end
end
for _, a in ipairs(plan['acks']) do
  if owned[a[1]] then ack(plan['owners'][a[1]]) end
end
if s then
  if not trusted then redis.call('SADD', KEYS[s[3]], ARGV[2]) end
  if #s > 4 then redis.call('HDEL', KEYS[s[4]], unpack(s, 5)) end
end
return refused
""")


EXPIRE_EVERY = 64  # an output stream's expiry is pushed out at its first chunk, every 64th and its last


def _expires(c: OutputChunk) -> int:
    """1 when writing `c` pushes its output stream's expiry out (EXPIRE_EVERY)."""
    return int(c.seq % EXPIRE_EVERY == 0 or c.final)

# The same flush while the fence holds, which is nearly always: no ownership to check, so no plan to decode
# (_FLUSH's cjson and its walk cost ~60 us of Redis CPU for 32 chunks; this one ~9 us besides its XADDs): each
# inbox's chunks come joined, the keys and values in order, and the acks of one stream go in one XACK and one
# XDEL. -1, having written nothing, when the status in Redis is not this run's: then _FLUSH runs, with its
# checks. No hand-backs here (they need _FLUSH's plan). With a status, the fence is read by the status's own
# SET ... GET (one command, not two); when it finds the fence down it puts back what was there, so _FLUSH
# judges the same status.
#   KEYS   status, reservations, the inboxes (ARGV[4] of them), the output streams (ARGV[5]), the acks' streams
#          (ARGV[6])
#   ARGV   run id, status JSON ('' none), its ttl ms, the three counts, output ttl ms, group, field, the number of
#          taken request ids; then those ids, each inbox's joined chunks, (chunk, expire 0/1) per output
#          stream, per acks' stream the number of its entries and their ids
_FLUSH_FENCED = LuaScript("""
local before
if ARGV[2] ~= '' then
  before = redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'GET')
else
  before = redis.call('GET', KEYS[1])
end
if not (ARGV[1] ~= '' and type(before) == 'string' and string.find(before, ARGV[1], 1, true)) then
  if ARGV[2] ~= '' then
    if type(before) == 'string' then redis.call('SET', KEYS[1], before, 'PX', ARGV[3]) else redis.call('DEL', KEYS[1]) end
  end
  return -1
end
local nb, nc, na, nt = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[10])
local group, field = ARGV[8], ARGV[9]
local k, a = 3, 11 + nt
for _ = 1, nb do
  redis.call('XADD', KEYS[k], 'NOMKSTREAM', '*', field, ARGV[a])
  k, a = k + 1, a + 1
end
for _ = 1, nc do
  redis.call('XADD', KEYS[k], '*', field, ARGV[a])
  if ARGV[a + 1] == '1' then redis.call('PEXPIRE', KEYS[k], ARGV[7]) end
  k, a = k + 1, a + 2
end
for _ = 1, na do
  local last = a + tonumber(ARGV[a])
  for first = a + 1, last, 256 do  -- unpack's stack limit
    local upto = math.min(first + 255, last)
    redis.call('XACK', KEYS[k], group, unpack(ARGV, first, upto))
    redis.call('XDEL', KEYS[k], unpack(ARGV, first, upto))
  end
  k, a = k + 1, last + 1
end
if ARGV[2] ~= '' and nt > 0 then redis.call('HDEL', KEYS[2], unpack(ARGV, 11, 10 + nt)) end
return 0
""")


def _publish_fenced(r: redis.Redis, worker_id: str, shard: int, run_id: str, output_ttl_s: float,
                    bodies: list[tuple[OutputChunk, str]], reply_to: Mapping[str, str], acks: Sequence[Ack],
                    status: WorkerStatus | None, status_ttl_s: float, taken: Sequence[str]) -> bool:
    """_FLUSH_FENCED: False when the fence is down (nothing was written)."""
    boxes: dict[str, list[str]] = {}
    out: list[tuple[str, str, int]] = []
    for c, text in bodies:
        if (gateway := reply_to.get(c.request_id)) is not None:
            boxes.setdefault(keys.inbox(gateway, shard), []).append(text)
        else:
            out.append((keys.out_stream(c.request_id, shard), text, _expires(c)))
    acked: dict[str, list[str]] = {}
    for a in acks:
        acked.setdefault(a.stream, []).append(a.entry_id)
    names = [keys.status(worker_id, shard), keys.reserved(worker_id, shard), *boxes, *(o[0] for o in out), *acked]
    args: list[Any] = [run_id, status.model_dump_json() if status is not None else "", int(status_ttl_s * 1000),
                       len(boxes), len(out), len(acked), int(output_ttl_s * 1000), keys.GROUP, keys.FIELD,
                       len(taken) if status is not None else 0, *(taken if status is not None else ())]
    args += ["[" + ",".join(parts) + "]" for parts in boxes.values()]
    for _name, text, expire in out:
        args += [text, expire]
    for ids in acked.values():
        args += [len(ids), *ids]
    return run_script(r, _FLUSH_FENCED, names, args) != -1


class _Plan:
    """Builds _FLUSH's KEYS and plan: each key and each owner once, referred to by index."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self._key_ix: dict[str, int] = {}
        self.owners: list[Ack] = []
        self._owner_ix: dict[Ack, int] = {}

    def key(self, name: str) -> int:
        if name not in self._key_ix:
            self.keys.append(name)
            self._key_ix[name] = len(self.keys)
        return self._key_ix[name]

    def owner(self, ack: Ack | None) -> int:
        if ack is None:
            return 0
        if ack not in self._owner_ix:
            self.owners.append(ack)
            self._owner_ix[ack] = len(self.owners)
            self.key(ack.stream)
        return self._owner_ix[ack]

    def owner_rows(self) -> list[list[Any]]:
        return [[self._key_ix[a.stream], a.entry_id, a.deliveries] for a in self.owners]


def publish(r: redis.Redis, worker_id: str, *, output_ttl_s: float, chunks: Sequence[OutputChunk] = (),
            requeued: Sequence[tuple[GenerationRequest, Ack]] = (), acks: Sequence[Ack] = (),
            owners: Mapping[str, Ack] | None = None, reply_to: Mapping[str, str] | None = None,
            status: WorkerStatus | None = None, status_ttl_s: float = 0.0, taken: Sequence[str] = (),
            run_id: str = "", held: Sequence[Ack] = (), shard: int = 0) -> list[Ack]:
    """One flush, one script, in this order: the output chunks, the hand-backs (XADD to the shared stream + ack
    of the old entry), the acks (XACK + XDEL, so an entry is acked only with or after the chunks before it),
    and with `status` the HDEL of the reservations of the `taken` requests, which that status now counts.
    The status (SET with a TTL of status_ttl_s) goes first: it is the fence (see _FLUSH). While the fence
    holds (the status in Redis is this run's) a flush without hand-backs runs as _FLUSH_FENCED, which has
    nothing to check; else, or when it finds the fence down, as _FLUSH.

    Every key is the worker's `shard`'s. A chunk of a request with a `reply_to` gateway goes into that gateway's
    inbox of the shard, in one entry per inbox per flush with
    all of the flush's chunks for it; the others into their request's own stream (XADD; the expiry pushed out
    to output_ttl_s at its first chunk, every EXPIRE_EVERY-th and its last). A chunk is written under
    `owners[chunk.request_id]` (unchecked when absent), a hand-back and an ack under their own Ack: checked
    only when the status in Redis is not this run's (`run_id`), and then every delivery in `held` (all the
    worker holds, given with `status`: the status written here re-arms the fence) is checked too, so one it
    lost without a write in this flush is found as well. Returns the owners this
    worker no longer holds: nothing was written under them."""
    owners, reply_to = owners or {}, reply_to or {}
    texts = [(c, c.model_dump_json(exclude_defaults=True)) for c in chunks]
    if run_id and not requeued and _publish_fenced(r, worker_id, shard, run_id, output_ttl_s, texts, reply_to, acks,
                                                   status, status_ttl_s, taken):
        return []
    plan, bodies = _Plan(), [worker_id, run_id]

    def body(text: str) -> int:  # its ARGV index
        bodies.append(text)
        return len(bodies) + 1

    rows: dict[str, Any] = {"group": keys.GROUP, "field": keys.FIELD, "ttl": int(output_ttl_s * 1000),
                            "fence": plan.key(keys.status(worker_id, shard))}
    rows["chunks"], boxes = [], {}
    for c, text in texts:
        owner, at = plan.owner(owners.get(c.request_id)), body(text)
        if (gateway := reply_to.get(c.request_id)) is not None:
            boxes.setdefault(keys.inbox(gateway, shard), []).append([owner, at])
        else:
            rows["chunks"].append([owner, plan.key(keys.out_stream(c.request_id, shard)), at, _expires(c)])
    rows["inboxes"] = [[plan.key(inbox), parts] for inbox, parts in boxes.items()]
    if requeued:
        rows["any"], rows["moved"] = plan.key(keys.req_any(shard)), keys.MOVED_FIELD
    rows["requeued"] = [[plan.owner(ack), body(request.model_dump_json())]
                        + ([plan.key(keys.inbox(request.reply_to, shard)), request.request_id]
                           if request.reply_to else [])
                        for request, ack in requeued]
    rows["acks"] = [[plan.owner(ack)] for ack in acks]
    for ack in held:
        plan.owner(ack)
    if status is not None:
        rows["status"] = [body(status.model_dump_json()), int(status_ttl_s * 1000), plan.key(keys.workers(shard)),
                          plan.key(keys.reserved(worker_id, shard)), *taken]
    rows["owners"] = plan.owner_rows()
    refused = run_script(r, _FLUSH, plan.keys, [json.dumps(rows), *bodies])
    return [plan.owners[i - 1] for i in refused or []]


def keep_status(r: redis.Redis, worker_id: str, ttl_s: float, shard: int = 0) -> bool:
    """Push out the expiry of the worker's status as it is (PEXPIRE, which a full Redis still takes, where the
    flush's SET is refused): the worker stays in the fleet while its writes wait. -> whether it was there."""
    return bool(r.pexpire(keys.status(worker_id, shard), max(1, int(ttl_s * 1000))))


def leave(r: redis.Redis, worker_id: str, shard: int = 0) -> bool:
    """The worker stops: delete its status, so to the others it is dead at once and they take over what it
    left; when it left nothing, it leaves the fleet too (as prune_dead_worker forgets a dead one), so gateways
    do not wait for it to come back (gateway.placement). True: it left the fleet."""
    r.delete(keys.status(worker_id, shard))
    return prune_dead_worker(r, worker_id, shard)
