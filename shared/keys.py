"""Every Redis key, stream and consumer-group name kvfleet uses. Nothing else spells a key.

Shards. The fleet's keys fall into shards, one hash tag each ("{s0}", "{s1}", ...): every key one atomic step
touches (a Lua script, a MULTI) is in one shard, so on Redis Cluster each step runs on one slot, and the
shards spread over the masters. A worker lives in one shard (shard_of its id, among KVFLEET_REDIS_SHARDS; its
status says which), and so do the requests it holds: its own stream, its shard's shared stream, their leases
and output; a request never leaves its shard (hand-backs, forwards and takeovers stay inside it). An unsharded
fleet (one Redis, the default) is shard 0 alone.

Streams (consumer group GROUP on each request stream):
  kvfleet:{s}:req:{worker}   requests the router placed on one worker
  kvfleet:{s}:req:any        requests any worker of shard s with room takes (no worker fitted when they came)
  kvfleet:{s}:out:{request}  numbered OutputChunks of one request; expires after it is read (requests without a
                             reply_to: services' jobs; and a gateway's restore of what it relayed, on re-placing)
  kvfleet:{s}:inbox:{gateway} one gateway's output from shard s: each worker flush adds one entry holding every
                             chunk it wrote for that gateway's requests (their reply_to); the gateway reads it,
                             trims what it read and keeps its expiry (workers never create it: a gateway's death
                             ends it); also where a worker says it moved one of that gateway's requests (MOVED_FIELD)
  kvfleet:cancel             cancels, read by every worker (plain XREAD, no group)
  kvfleet:dead               dead letters: requests that failed on max_deliveries workers
Keys:
  kvfleet:{s}:status:{worker}    WorkerStatus JSON, SET with a TTL: its absence means the worker is dead
  kvfleet:{s}:workers            set of every worker of shard s ever seen (dead ones are pruned once drained)
  kvfleet:{s}:reserved:{worker}  hash request id -> KV blocks the gateways routed there that the worker's
                                 status does not show yet (the worker deletes a field when it takes the request)
  kvfleet:{s}:lease:{request}    a gateway's lease on a request it relays, SET with a short TTL and refreshed while
                                 its client is connected: its absence tells the worker nobody waits, so it aborts
  kvfleet:{s}:enq:{request}      the mark of a request's enqueue without a lease (services' jobs): the call's nonce
                                 and entry id for a minute, so that the same call sent again enqueues nothing
  kvfleet:shards                 set of the shards any worker ever lived in (where the fleet reads look)
  kvfleet:cancelled:{request}    marker with a TTL, so a cancel that beats the request to a worker still counts
  kvfleet:prefix:{first}:{hash}  workers a prompt prefix (chained hash of full blocks) was last routed to; tagged by
                                 the prompt's first block, so one prompt's blocks share a slot
  kvfleet:rr                     round-robin turn counter shared by gateway replicas
  kvfleet:job:{request}          job record of a request id placed by services (Celery, client, batch files):
                                 makes each id enter the fleet at most once (services.job_record)
"""

from __future__ import annotations

import re
import zlib

PREFIX = "kvfleet"
GROUP = "kvfleet-workers"

CANCEL = f"{PREFIX}:cancel"
DEAD = f"{PREFIX}:dead"
SHARDS = f"{PREFIX}:shards"
ROUND_ROBIN = f"{PREFIX}:rr"

# The single field every stream entry carries: the pydantic message as JSON.
FIELD = "m"
# An inbox entry's other kind: a gateway's request that a worker put on another stream (a hand-back to
# the shared stream, a forward), as JSON [request id, stream, entry id], so its relay follows it there.
MOVED_FIELD = "moved"


# What kvfleet keeps at each kind of name (the answer of Redis's TYPE): a key of another type there is another
# program's (or kvfleet version's) write, which shared.streams.key_types finds and names; kvfleet never deletes it.
TYPES = {"req": "stream", "out": "stream", "inbox": "stream", "cancel": "stream", "dead": "stream",
         "status": "string", "lease": "string", "enq": "string", "rr": "string", "cancelled": "string",
         "job": "string", "prefix": "string", "workers": "set", "shards": "set", "reserved": "hash"}


def redis_type(key: str) -> str | None:
    """The Redis type kvfleet keeps at `key` (TYPES), None for a name that is not kvfleet's."""
    parts = key.split(":")
    if len(parts) < 2 or parts[0] != PREFIX:
        return None
    kind = parts[2] if parts[1].startswith("{s") and len(parts) > 2 else parts[1]
    return TYPES.get(kind)


def shard_of(worker_id: str, shards: int) -> int:
    """The shard a worker lives in: its id's trailing number modulo `shards` when it ends in digits (w0, w1,
    ... and StatefulSet pods worker-0, worker-1, ... spread evenly), else a CRC32 of the id."""
    digits = len(worker_id) - len(worker_id.rstrip("0123456789"))
    number = int(worker_id[-min(digits, 9):]) if digits else zlib.crc32(worker_id.encode())
    return number % max(1, shards)


def _in(shard: int) -> str:
    return f"{PREFIX}:{{s{shard}}}"


def req_stream(worker_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:req:{worker_id}"


def req_any(shard: int = 0) -> str:
    return f"{_in(shard)}:req:any"


def out_stream(request_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:out:{request_id}"


def inbox(gateway_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:inbox:{gateway_id}"


def status(worker_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:status:{worker_id}"


def workers(shard: int = 0) -> str:
    return f"{_in(shard)}:workers"


STATUSES = f"{PREFIX}:{{s*}}:status:*"  # every worker's status in every shard: a SCAN's MATCH
_STATUS = re.compile(rf"^{PREFIX}:\{{s(\d+)\}}:status:(.+)$")


def status_of(name: str) -> tuple[str, int] | None:
    """(worker id, shard) of a status key's name; None for any other name."""
    m = _STATUS.match(name)
    return (m.group(2), int(m.group(1))) if m else None


def reserved(worker_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:reserved:{worker_id}"


def lease(request_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:lease:{request_id}"


def enqueued(request_id: str, shard: int = 0) -> str:
    return f"{_in(shard)}:enq:{request_id}"


def cancelled(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def job(request_id: str) -> str:
    return f"{PREFIX}:job:{request_id}"


def prefix_block(block_hash: str, first_hash: str) -> str:
    return f"{PREFIX}:prefix:{{{first_hash}}}:{block_hash}"


def stream_shard(stream: str) -> int:
    """The shard of a request stream's name (as req_stream / req_any spell it)."""
    return int(stream.split("{s", 1)[1].split("}", 1)[0])


def validate_worker_id(worker_id: str) -> str:
    """Worker ids become part of key names: keep them to a safe alphabet."""
    if not worker_id or worker_id == "any" or any(not (c.isalnum() or c in "-_.") for c in worker_id):
        raise ValueError(f"worker id must be letters, digits, '-', '_' or '.', and not 'any'; got {worker_id!r}")
    return worker_id
