"""Job records of request ids placed by services (Celery, the client, batch files): each id enters the fleet
at most once (services.job_record holds the protocol)."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import keys
from shared.streams.client import LuaScript, arun_script
from shared.streams.fleet import aread_members, aread_shards
from shared.streams.output import aoutput_exists
from shared.streams.requests import parse_request

# ---- job records ----------------------------------------------------------------------------------
# kvfleet:job:{request} as JSON text, and the fleet's streams searched for a request. services.job_record
# owns the protocol (the record's states and who may move it on); these are its atomic steps.

JOB_SCAN_PAGE = 500

# KEYS[1] record; ARGV: our placing record, now, lease seconds, ttl ms -> {1 fresh | 2 taken over | 0 held, old}.
# Taken over: a placing record older than the lease, or one this version cannot read (another program's write).
# Our own record there already (unique: its owner and time): this same call, sent again by redis-py after its reply
# was lost; answered as a takeover of nothing known, so that the caller looks for the request in the fleet before it
# places it (the first run may have taken over a dead attempt's record), where "held" would have it wait out its
# own lease.
_CLAIM_JOB = LuaScript("""
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return {2, ''} end
if cur then
  local ok, rec = pcall(cjson.decode, cur)
  -- readable as services.job_record.Record.parse reads it; else another program's or version's: taken over
  local readable = ok and type(rec) == 'table' and type(rec.since) == 'number' and (rec.state == 'placing'
    or (rec.state == 'enqueued' and type(rec.call) == 'table')
    or (rec.state == 'done' and type(rec.call) == 'table' and type(rec.result) == 'table'))
  if readable and not (rec.state == 'placing' and tonumber(ARGV[2]) - rec.since > tonumber(ARGV[3])) then
    return {0, cur}
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
if cur then return {2, cur} end
return {1, ''}
""")

# KEYS[1] record; ARGV: expected value, new value ('' deletes), ttl ms -> 1 replaced | 0 not ours any more. The new
# value there already: this same call, sent again after its reply was lost (1, as the first run answered).
_REPLACE_JOB = LuaScript("""
local cur = redis.call('GET', KEYS[1])
if ARGV[2] ~= '' and cur == ARGV[2] then return 1 end
if cur ~= ARGV[1] then return 0 end
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


async def afinish_job(r: aioredis.Redis, request_id: str, shard: int, record: str, *, ttl_s: float,
                      output_ttl_s: float) -> None:
    """Store the finished record, and let the output stream (in `shard`) expire in `output_ttl_s`: one round
    trip (not a MULTI: on Redis Cluster the two keys are in different slots, and neither needs the other)."""
    pipe = r.pipeline(transaction=False)
    pipe.set(keys.job(request_id), record, px=int(ttl_s * 1000))
    pipe.pexpire(keys.out_stream(request_id, shard), int(output_ttl_s * 1000))
    await pipe.execute()


async def arequest_in_fleet(r: aioredis.Redis, request_id: str) -> int | None:
    """Was the request enqueued, and in which shard? Its entry stays in a request stream until the worker
    writes its final chunk (the ack and XDEL go in the same script as that chunk), so: look in every shard's
    streams first, then for its output. None: nowhere."""
    in_use = await aread_shards(r)
    members = await aread_members(r, in_use)
    for shard in in_use:
        names = [keys.req_any(shard)] + [keys.req_stream(w, k) for w, k in sorted(members.items()) if k == shard]
        for name in names:
            start = "-"
            while True:
                entries = await r.xrange(name, min=start, max="+", count=JOB_SCAN_PAGE)
                for _entry_id, fields in entries:
                    if request_id in fields.get(keys.FIELD, "") and parse_request(fields).request_id == request_id:
                        return shard
                if len(entries) < JOB_SCAN_PAGE:
                    break
                start = "(" + entries[-1][0]
    for shard in in_use:
        if await aoutput_exists(r, request_id, shard):
            return shard
    return None
