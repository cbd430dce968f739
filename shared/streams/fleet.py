"""Fleet reads: live workers, their reservations and the streams (what the gateway routes on and what
/v1/fleet, `kvfleet status` / `top` and the fleet gauges show), the round-robin turn, and the prefix index."""

from __future__ import annotations

import time
import weakref
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import fleet_state, keys
from shared.fleet_state import FleetSnapshot, FleetView, StreamInfo
from shared.streams.client import LuaScript, arun_script, wrong_type
from shared.streams.key_types import RECHECK_S, afind, araise_named, aread_set

# ---- fleet reads ----------------------------------------------------------------------------------
# What the gateway routes on, and what GET /v1/fleet, `kvfleet status` / `top` and the gateway's fleet
# gauges show (shaped by shared.fleet_state). Read afresh for each request, so gateway replicas agree
# without talking to each other.

async def aping(r: aioredis.Redis) -> None:
    """Raises (a RedisError) unless Redis answers."""
    await r.ping()


async def aread_shards(r: aioredis.Redis) -> list[int]:
    """The shards workers ever lived in (shard 0 always). A member that is not a shard number (a foreign write) is
    left out, where it failed every read of the fleet; a kvfleet:shards of another type is read around (key_types.read_set)."""
    members = await aread_set(r, keys.SHARDS, "the fleet reads")
    if members is None:
        members = {str(k) for k in (await _by_status_keys(r)).values()}
    return sorted({0} | {int(k) for k in members if k.isascii() and k.isdigit()})


async def aread_members(r: aioredis.Redis, in_use: list[int]) -> dict[str, int]:
    """Every worker ever seen in the shards `in_use`, with its shard: one round trip. A shard's workers set of
    another type is read around (key_types.read_set): that shard's live workers are found by their status keys."""
    pipe = r.pipeline(transaction=False)
    for k in in_use:
        pipe.smembers(keys.workers(k))
    members: dict[str, int] = {}
    for k, found in zip(in_use, await pipe.execute(raise_on_error=False), strict=True):
        if isinstance(found, Exception):
            found = await aread_set(r, keys.workers(k), "the fleet reads", found)
        if found is None:
            found = [w for w, shard in (await _by_status_keys(r)).items() if shard == k]
        members.update((w, k) for w in found)
    return members


# kvfleet:shards, or a shard's workers set, of another type (another program's write) is read around: the shards and
# their live workers are then found by their status keys (a SCAN, at most every RECHECK_S per client), and the key is
# logged once a minute and named by `kvfleet status` and GET /v1/fleet (afleet_snapshot). Before, every request got
# a 503 naming the key: one stray write kept the whole fleet from taking requests until an operator deleted it.
# A scan whose workers hold no live one is not kept (aread_fleet): after Redis was away past the status TTL every
# status has expired, the workers re-register within a heartbeat, and a gateway waits only two heartbeats for them
# (gateway.targets.live_view). Kept for RECHECK_S, a scan made as Redis came back, before they were back, hid them,
# and requests got 503 no_workers from a fleet of three live workers (chaos seed 257: the set a string for 20 s, Redis
# paused 11 s within it, and another version's status in the fleet, which such a scan finds alone). A fleet with no
# live worker so scans at each read, while that key stays: a gateway's reads come at most every fleet_view_max_age_s.
# Per client, and gone with it (keyed by id, a new client could take over a freed one's scan).
_scanned: weakref.WeakKeyDictionary[Any, tuple[float, dict[str, int]]] = weakref.WeakKeyDictionary()


async def _by_status_keys(r: aioredis.Redis) -> dict[str, int]:
    """Every worker with a status, with its shard, found by a SCAN of the status keys (every master of a cluster);
    the last scan's answer when it is under RECHECK_S old."""
    at, found = _scanned.get(r, (float("-inf"), {}))
    if time.monotonic() - at >= RECHECK_S:
        found = {}
        async for name in r.scan_iter(match=keys.STATUSES, count=1000):
            if (worker := keys.status_of(name)) is not None:
                found[worker[0]] = worker[1]
        _scanned[r] = (time.monotonic(), found)
    return found


async def aread_fleet(r: aioredis.Redis, in_use: list[int] | None = None) -> FleetView:
    """Every worker ever seen, in every shard (`in_use`: as aread_shards found them, read afresh when None): the
    live ones (status present) with the blocks reserved on them, the dead ones. Two round trips (three with
    the shards): the shards' workers, then their statuses and reservations."""
    in_use = in_use if in_use is not None else await aread_shards(r)
    shards = await aread_members(r, in_use)
    view = FleetView(shards=shards, in_use=in_use)
    if shards:
        await _read_statuses(r, view)
    if not view.live:
        _scanned.pop(r, None)  # the workers may have come from a scan: the next read scans again (_scanned)
    return view


async def _read_statuses(r: aioredis.Redis, view: FleetView) -> None:
    """Each of the view's workers into live (with its reservations), dead or unreadable: one round trip."""
    members = sorted(view.shards)
    pipe = r.pipeline(transaction=False)
    for w in members:
        pipe.get(keys.status(w, view.shards[w]))
        pipe.hvals(keys.reserved(w, view.shards[w]))
    # a key of another type (another version's or program's write) comes back as its error, not raised: that
    # worker's status is unreadable, its reservations none
    replies = await pipe.execute(raise_on_error=False)
    for w, raw, reserved in zip(members, replies[0::2], replies[1::2], strict=True):
        if raw is None:
            view.dead.append(w)
            continue
        try:
            if isinstance(raw, Exception):
                raise fleet_state.unreadable(w, fleet_state.NOT_A_STRING)
            status = fleet_state.parse_status(w, raw)
        except fleet_state.UnreadableStatus as e:
            view.unreadable[w] = str(e)
            continue
        view.live.append(status)
        view.reservations[w] = 0 if isinstance(reserved, Exception) else reserved_blocks(reserved, status.total_blocks)


def reserved_blocks(values: list[str], most: int) -> int:
    """The KV blocks a worker's reservations hash holds: each field's value, a request's block count. A value that
    is not a count (another program's write, another version's) counts nothing, here as in the enqueue's check
    (shared.streams.requests), instead of failing every read of the fleet; nor does one over the worker's whole
    cache (`most`), which no gateway reserves (that worker would look full for as long as gateways reserve there)."""
    return sum(n for v in values if v.isascii() and v.isdigit() and (n := int(v)) <= most)


async def _astream_info(r: aioredis.Redis, stream: str) -> StreamInfo:
    pipe = r.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xinfo_groups(stream)
    try:
        length, groups = await pipe.execute()
    except redis.ResponseError as e:  # no such stream; a key of another type is named (afleet_snapshot)
        if wrong_type(e):
            raise
        return {"length": 0, "pending": 0}
    return {"length": length, "pending": sum(g.get("pending", 0) for g in groups)}


async def afleet_snapshot(r: aioredis.Redis) -> FleetSnapshot:
    """The fleet at a glance: workers, request streams with their pending counts, dead letters, Redis's memory."""
    try:
        view = await aread_fleet(r)
        infos = {name: await _astream_info(r, name) for name in fleet_state.snapshot_streams(view)}
        dead_letters = await r.xlen(keys.DEAD)
    except redis.ResponseError as e:  # a WRONGTYPE names the key (`kvfleet status` shows it)
        await araise_named(r, e)
    # the sets the reads went around (key_types.read_set): named here, where an operator looks
    around = await afind(r, [keys.SHARDS, *(keys.workers(k) for k in view.in_use)])
    return fleet_state.snapshot(view, infos, dead_letters, time.time(), await _aredis_state(r),
                                [str(f) for f in around])


async def _aredis_state(r: aioredis.Redis) -> dict[str, Any] | None:
    """used_memory, maxmemory and its policy (INFO memory), and persistence_error: what failed of its persistence
    ("" when nothing did: INFO persistence); None on a cluster (a figure per master)."""
    if isinstance(r, aioredis.RedisCluster):
        return None
    info, saved = await r.info("memory"), await r.info("persistence")
    failed = ("its AOF cannot be written: it refuses writes" if saved.get("aof_enabled")
              and saved.get("aof_last_write_status") == "err" else "its last RDB snapshot failed: with save points, it "
              "refuses writes" if saved.get("rdb_last_bgsave_status") == "err" else "")
    return {"used_memory": int(info["used_memory"]), "maxmemory": int(info.get("maxmemory", 0)),
            "maxmemory_policy": info.get("maxmemory_policy", ""), "persistence_error": failed}


async def anext_turn(r: aioredis.Redis) -> int:
    """The next round-robin turn, counted in Redis so that gateway replicas share one rotation. A counter that is
    not a number, or a key of another type (a foreign write; INCR refuses either), starts again from 1."""
    try:
        return await r.incr(keys.ROUND_ROBIN)
    except redis.ResponseError as e:
        if "not an integer" not in str(e) and not wrong_type(e):
            raise
        await r.set(keys.ROUND_ROBIN, 1)
        return 1


# ---- prefix index ---------------------------------------------------------------------------------
# The `prefix` routing policy's approximate view of each worker's prefix cache: the workers each prompt block
# (by its chained hash, shared.blocks.block_hashes) was last routed to, most recent first, up to PREFIX_OWNERS
# of them (a hot prompt outgrows one worker; those that took it before still hold it), shared by gateway
# replicas, with a TTL from the last routing. One string per block: "w7,w2,w9".

PREFIX_TTL_S = 600
PREFIX_OWNERS = 4

# For each block: the worker first, then the earlier owners but it, at most ARGV[3] in all; expires in ARGV[2] s.
_REMEMBER_PREFIX = LuaScript("""
local worker, ttl, most = ARGV[1], ARGV[2], tonumber(ARGV[3])
for _, key in ipairs(KEYS) do
  local owners = {worker}
  local old = redis.call('GET', key)
  if old then
    for owner in string.gmatch(old, '[^,]+') do
      if owner ~= worker and #owners < most then owners[#owners + 1] = owner end
    end
  end
  redis.call('SET', key, table.concat(owners, ','), 'EX', ttl)
end
""")


async def aprefix_owners(r: aioredis.Redis, hashes: list[str]) -> list[list[str]]:
    """The workers each block of one prompt (`hashes`, from its first block on) was last routed to, most
    recent first; [] where none was (or its entry expired). One MGET (the keys share the first block's tag)."""
    if not hashes:
        return []
    return [v.split(",") if v else [] for v in await r.mget([keys.prefix_block(h, hashes[0]) for h in hashes])]


async def aremember_prefix(r: aioredis.Redis, hashes: list[str], worker_id: str, *,
                           ttl_s: float = PREFIX_TTL_S, owners: int = PREFIX_OWNERS) -> None:
    """These blocks of one prompt were just routed to `worker_id` (one script run: it keeps up to `owners` per
    block)."""
    if hashes:
        await arun_script(r, _REMEMBER_PREFIX, [keys.prefix_block(h, hashes[0]) for h in hashes],
                          [worker_id, int(ttl_s), owners])
