"""A worker's outbox, one Lua script per flush (gpu_worker.serve.outbox): its output chunks, hand-backs, acks and
status, atomically; and its status kept alive while Redis refuses writes.

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
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from shared import keys
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.streams.client import LuaScript, run_script
from shared.streams.key_types import KeyOfAnotherType, report
from shared.streams.worker import Ack

# The worker's writer thread (gpu_worker.serve.outbox): everything it writes goes in one script per flush.

# A key of another type where a flush writes (a gateway's inbox, an output stream, the workers set: another program's
# write) is left out of the flush and named in its reply, {key, its type, ...}: the worker's other outputs go on,
# where the WRONGTYPE failed every flush, and so all its output, for good. `try` is redis.call but for that; any other
# error (Redis full, unable to persist) is `fatal`, and the script returns it at once, as redis.call would have
# failed it there (what ran before stays, as then).
SKIP_LUA = """
local skipped, fatal = {}, nil
local function try(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply['err'] then
    if string.sub(reply['err'], 1, 9) ~= 'WRONGTYPE' then fatal = reply return nil end
    skipped[#skipped + 1] = key
    skipped[#skipped + 1] = redis.call('TYPE', key)['ok']
    return nil
  end
  return reply
end
"""

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
# Writes under an owner that fails its check are skipped; the reply lists those owners (1-based), and the keys of
# another type it left out (SKIP_LUA).
_FLUSH = LuaScript(SKIP_LUA + """
local plan = cjson.decode(ARGV[1])
local group, field = plan['group'], plan['field']
local s = plan['status']
local before
if s then  -- a status of another type is not written over (nor trusted)
  before = try('SET', KEYS[plan['fence']], ARGV[s[1]], 'PX', s[2], 'GET')
else
  before = try('GET', KEYS[plan['fence']])
end
if fatal then return fatal end
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
  if try('XACK', KEYS[o[1]], group, o[2]) then redis.call('XDEL', KEYS[o[1]], o[2]) end
end
for _, c in ipairs(plan['chunks']) do
  if c[1] == 0 or owned[c[1]] then
    local added = try('XADD', KEYS[c[2]], '*', field, ARGV[c[3]])
    if fatal then return fatal end
    if added and c[4] == 1 then redis.call('PEXPIRE', KEYS[c[2]], plan['ttl']) end
  end
end
for _, box in ipairs(plan['inboxes']) do
  local parts = {}
  for _, c in ipairs(box[2]) do
    if c[1] == 0 or owned[c[1]] then parts[#parts + 1] = ARGV[c[2]] end
  end
  if #parts > 0 then
    try('XADD', KEYS[box[1]], 'NOMKSTREAM', '*', field, '[' .. table.concat(parts, ',') .. ']')
    if fatal then return fatal end
  end
end
local handing = #plan['requeued'] == 0
if not handing then  -- the shared stream of another type takes no hand-back: refused, the worker takes it again
  local kind = redis.call('TYPE', KEYS[plan['any']])['ok']
  handing = kind == 'stream' or kind == 'none'
  if not handing then skipped[#skipped + 1] = KEYS[plan['any']] skipped[#skipped + 1] = kind end
end
for _, q in ipairs(plan['requeued']) do
  local o = plan['owners'][q[1]]
  if not handing then refused[#refused + 1] = q[1] end
  -- the ack first: 0 when the entry was no longer pending (this flush ran already, its reply lost, and it was
  -- sent again): the hand-back is not made twice
  if handing and owned[q[1]] and redis.call('XACK', KEYS[o[1]], group, o[2]) == 1 then
    redis.call('XDEL', KEYS[o[1]], o[2])
    local id = redis.call('XADD', KEYS[plan['any']], '*', field, ARGV[q[2]])
    if q[3] then  -- a gateway's request: where it is now, for its relay's silence check
      try('XADD', KEYS[q[3]], 'NOMKSTREAM', '*', plan['moved'], cjson.encode({q[4], KEYS[plan['any']], id}))
      if fatal then return fatal end
    end
  end
end
for _, a in ipairs(plan['acks']) do
  if owned[a[1]] then ack(plan['owners'][a[1]]) end
  if fatal then return fatal end
end
if s then
  if not trusted then try('SADD', KEYS[s[3]], ARGV[2]) end
  if #s > 4 then try('HDEL', KEYS[s[4]], unpack(s, 5)) end
end
if fatal then return fatal end
return {refused, skipped}
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
#   KEYS   status, reservations, the shard's workers set (SADD with each status: ~1 us), the inboxes (ARGV[4] of
#          them), the output streams (ARGV[5]), the acks' streams (ARGV[6])
#   ARGV   run id, status JSON ('' none), its ttl ms, the three counts, output ttl ms, group, field, the number of
#          taken request ids; then those ids, each inbox's joined chunks, (chunk, expire 0/1) per output
#          stream, per acks' stream the number of its entries and their ids; last, the worker id
_FLUSH_FENCED = LuaScript(SKIP_LUA + """
local before
if ARGV[2] ~= '' then
  before = try('SET', KEYS[1], ARGV[2], 'PX', ARGV[3], 'GET')
else
  before = try('GET', KEYS[1])
end
if fatal then return fatal end
if #skipped > 0 then return -1 end  -- a status of another type: _FLUSH leaves it as it is
if not (ARGV[1] ~= '' and type(before) == 'string' and string.find(before, ARGV[1], 1, true)) then
  if ARGV[2] ~= '' then
    if type(before) == 'string' then redis.call('SET', KEYS[1], before, 'PX', ARGV[3]) else redis.call('DEL', KEYS[1]) end
  end
  return -1
end
local nb, nc, na, nt = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[10])
local group, field = ARGV[8], ARGV[9]
local k, a = 4, 11 + nt
for _ = 1, nb do
  try('XADD', KEYS[k], 'NOMKSTREAM', '*', field, ARGV[a])
  if fatal then return fatal end
  k, a = k + 1, a + 1
end
for _ = 1, nc do
  local added = try('XADD', KEYS[k], '*', field, ARGV[a])
  if fatal then return fatal end
  if added and ARGV[a + 1] == '1' then redis.call('PEXPIRE', KEYS[k], ARGV[7]) end
  k, a = k + 1, a + 2
end
for _ = 1, na do
  local last = a + tonumber(ARGV[a])
  for first = a + 1, last, 256 do  -- unpack's stack limit
    local upto = math.min(first + 255, last)
    if try('XACK', KEYS[k], group, unpack(ARGV, first, upto)) then redis.call('XDEL', KEYS[k], unpack(ARGV, first, upto)) end
    if fatal then return fatal end
  end
  k, a = k + 1, last + 1
end
if ARGV[2] ~= '' then
  if nt > 0 then try('HDEL', KEYS[2], unpack(ARGV, 11, 10 + nt)) end
  try('SADD', KEYS[3], ARGV[#ARGV])  -- a workers set deleted alone (one of another type, say) has it back
end
if fatal then return fatal end
return skipped
""")


def _publish_fenced(r: redis.Redis, worker_id: str, shard: int, run_id: str, output_ttl_s: float,
                    bodies: list[tuple[OutputChunk, str]], reply_to: Mapping[str, str], acks: Sequence[Ack],
                    status: WorkerStatus | None, status_ttl_s: float, taken: Sequence[str]) -> list[str] | None:
    """_FLUSH_FENCED: None when the fence is down (nothing was written), else the keys of another type it left out
    (SKIP_LUA's reply)."""
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
    names = [keys.status(worker_id, shard), keys.reserved(worker_id, shard), keys.workers(shard), *boxes,
             *(o[0] for o in out), *acked]
    args: list[Any] = [run_id, status.model_dump_json() if status is not None else "", int(status_ttl_s * 1000),
                       len(boxes), len(out), len(acked), int(output_ttl_s * 1000), keys.GROUP, keys.FIELD,
                       len(taken) if status is not None else 0, *(taken if status is not None else ())]
    args += ["[" + ",".join(parts) + "]" for parts in boxes.values()]
    for _name, text, expire in out:
        args += [text, expire]
    for ids in acked.values():
        args += [len(ids), *ids]
    args.append(worker_id)
    reply = run_script(r, _FLUSH_FENCED, names, args)
    return None if reply == -1 else reply


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
    lost without a write in this flush is found as well. A key of another type it writes to (a gateway's inbox, an
    output stream: another program's write) is left out and logged, and a hand-back it cannot make (the shared
    stream of another type) is refused, so the worker takes that request again. Returns the owners this
    worker no longer holds: nothing was written under them."""
    owners, reply_to = owners or {}, reply_to or {}
    texts = [(c, c.model_dump_json(exclude_defaults=True)) for c in chunks]
    if run_id and not requeued:
        skipped = _publish_fenced(r, worker_id, shard, run_id, output_ttl_s, texts, reply_to, acks, status,
                                  status_ttl_s, taken)
        if skipped is not None:
            _report_skipped(worker_id, skipped)
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
    refused, skipped = run_script(r, _FLUSH, plan.keys, [json.dumps(rows), *bodies])
    _report_skipped(worker_id, skipped)
    return [plan.owners[i - 1] for i in dict.fromkeys(refused or [])]


def _report_skipped(worker_id: str, skipped: list[str]) -> None:
    """Log the keys of another type a flush left out ([key, its type, ...]), each once a minute at most."""
    report([KeyOfAnotherType(key, kind, keys.redis_type(key) or "stream")
            for key, kind in zip(skipped[0::2], skipped[1::2], strict=True)], f"worker {worker_id}'s flush")


def keep_status(r: redis.Redis, worker_id: str, ttl_s: float, shard: int = 0) -> bool:
    """Push out the expiry of the worker's status as it is (PEXPIRE, which a full Redis still takes, where the
    flush's SET is refused): the worker stays in the fleet while its writes wait. -> whether it was there."""
    return bool(r.pexpire(keys.status(worker_id, shard), max(1, int(ttl_s * 1000))))
