"""Who a shard's workers are, and forgetting a dead one: every worker of the shard ever seen (its workers set, read
around when it holds another type), the streams an entry may be pending on, who holds pending entries where, the
other workers' statuses (None: dead), the atomic prune of a dead worker that left nothing behind, and a worker's
leaving. The worker's takeover scan (gpu_worker.serve.intake) reads these; the claims themselves are
shared.streams.worker's."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import redis

from shared import keys
from shared.fleet_state import NOT_A_STRING, UnreadableStatus, parse_status, unreadable
from shared.messages import WorkerStatus
from shared.streams.client import LuaScript, group_missing, run_script
from shared.streams.key_types import RECHECK_S, read_set


def register_shard(r: redis.Redis, shard: int) -> None:
    """A worker lives in `shard`: the fleet reads (aread_fleet) look there from now on."""
    r.sadd(keys.SHARDS, shard)


def request_streams(r: redis.Redis, shard: int = 0) -> list[str]:
    """Every stream of the shard an entry may be pending on for any worker: the shared stream and each known
    worker's own (a worker also reads new entries on the streams of workers it takes for dead, as itself: such an
    entry stays pending on it there)."""
    return [keys.req_any(shard)] + [keys.req_stream(w, shard) for w in sorted(shard_workers(r, shard))]


# client -> shard -> (when, workers): per client, and gone with it (keyed by id, a new client could take over a freed
# one's scan)
_scanned: weakref.WeakKeyDictionary[redis.Redis, dict[int, tuple[float, set[str]]]] = weakref.WeakKeyDictionary()


def shard_workers(r: redis.Redis, shard: int = 0) -> set[str]:
    """Every worker of the shard ever seen: its workers set. A set of another type (another program's write) is
    read around: the workers are then those with a request stream in the shard (a SCAN, at most every RECHECK_S per
    client), so the takeover still finds a dead worker (whose status is gone) and claims what it left pending. Once
    the set is back (an operator deleted the key; the live workers add themselves with their next status), the dead
    workers it lost are added back from their streams, to be taken over."""
    members, scans = read_set(r, keys.workers(shard), "the takeover scan"), _scanned.setdefault(r, {})
    if members is None:
        at, members = scans.get(shard, (float("-inf"), set()))
        if time.monotonic() - at >= RECHECK_S:
            members = _by_streams(r, shard)
            scans[shard] = (time.monotonic(), members)
        return members
    if scans.pop(shard, None) is not None and (lost := _by_streams(r, shard) - members):
        r.sadd(keys.workers(shard), *lost)
        members |= lost
    return members


def _by_streams(r: redis.Redis, shard: int) -> set[str]:
    """The workers with a request stream in the shard (a SCAN of every master)."""
    prefix = keys.req_stream("", shard)
    return {name[len(prefix):] for name in r.scan_iter(match=keys.req_stream("*", shard), count=1000, _type="stream")
            if name != keys.req_any(shard)}


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


def other_workers(r: redis.Redis, worker_id: str, shard: int = 0) -> dict[str, WorkerStatus | None]:
    """Every other worker of the shard ever seen, by id, with its status: None when the status expired (the
    worker is dead). One whose status this version cannot read is left out (shared.fleet_state.parse_status).
    One MGET: the statuses share the shard's slot."""
    members = sorted(shard_workers(r, shard) - {worker_id})
    raw = r.mget([keys.status(w, shard) for w in members]) if members else []
    # MGET answers nil for a key of another type too (another version's or program's write): such a status is
    # there, unreadable, not gone. TYPE tells them apart, asked only for the few that came back nil ("string": it
    # was written since the MGET; left out until the next look)
    missing = [w for w, s in zip(members, raw, strict=True) if s is None]
    kinds: dict[str, str] = {}
    if missing:
        pipe = r.pipeline(transaction=False)
        for w in missing:
            pipe.type(keys.status(w, shard))
        kinds = dict(zip(missing, pipe.execute(), strict=True))
    others: dict[str, WorkerStatus | None] = {}
    for w, s in zip(members, raw, strict=True):
        try:
            if kinds.get(w, "none") != "none":
                if kinds[w] != "string":
                    raise unreadable(w, NOT_A_STRING)
                continue
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
redis.pcall('SREM', KEYS[4], ARGV[2])  -- a workers set of another type: read around (shard_workers)
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
    pruned = bool(run_script(r, _PRUNE_DEAD, [keys.status(dead, shard), keys.req_stream(dead, shard),
                                              keys.reserved(dead, shard), keys.workers(shard), *others],
                             [keys.GROUP, dead]))
    if pruned and (scanned := _scanned.get(r, {}).get(shard)) is not None:
        scanned[1].discard(dead)  # read around a workers set of another type: not found again until the next SCAN
    return pruned


def leave(r: redis.Redis, worker_id: str, shard: int = 0) -> bool:
    """The worker stops: delete its status, so to the others it is dead at once and they take over what it
    left; when it left nothing, it leaves the fleet too (as prune_dead_worker forgets a dead one), so gateways
    do not wait for it to come back (gateway.targets). True: it left the fleet."""
    r.delete(keys.status(worker_id, shard))
    return prune_dead_worker(r, worker_id, shard)
