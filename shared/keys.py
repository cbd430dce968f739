"""Every Redis key, stream and consumer-group name kvfleet uses. Nothing else spells a key.

Streams (consumer group GROUP on each request stream):
  kvfleet:req:{worker}    requests the router placed on one worker
  kvfleet:req:any         requests any worker with room takes (no worker fitted when they came)
  kvfleet:out:{request}   numbered OutputChunks of one request; expires after it is read (requests without a
                          reply_to: services' jobs; and a gateway's restore of what it relayed, on re-placing)
  kvfleet:inbox:{gateway} one gateway's output: each worker flush adds one entry holding every chunk it wrote
                          for that gateway's requests (their reply_to); the gateway reads it, trims what it
                          read and keeps its expiry (workers never create it: a gateway's death ends it);
                          also where a worker says it moved one of that gateway's requests (MOVED_FIELD)
  kvfleet:cancel          cancels, read by every worker (plain XREAD, no group)
  kvfleet:dead            dead letters: requests that failed on max_deliveries workers
Keys:
  kvfleet:status:{worker}    WorkerStatus JSON, SET with a TTL: its absence means the worker is dead
  kvfleet:workers            set of every worker id ever seen (dead ones are pruned once drained)
  kvfleet:reserved:{worker}  hash request id -> KV blocks the gateways routed there that the worker's
                             status does not show yet (the worker deletes a field when it takes the request)
  kvfleet:cancelled:{request} marker with a TTL, so a cancel that beats the request to a worker still counts
  kvfleet:prefix:{hash}      worker a prompt prefix (chained hash of full blocks) was last routed to
  kvfleet:rr                 round-robin turn counter shared by gateway replicas
  kvfleet:lease:{request}    a gateway's lease on a request it relays, SET with a short TTL and refreshed while its
                             client is connected: its absence tells the worker nobody waits, so it aborts
  kvfleet:job:{request}      job record of a request id placed by services (Celery, client, batch files):
                             makes each id enter the fleet at most once (services.job_record)
"""

from __future__ import annotations

PREFIX = "kvfleet"
GROUP = "kvfleet-workers"

REQ_ANY = f"{PREFIX}:req:any"
CANCEL = f"{PREFIX}:cancel"
DEAD = f"{PREFIX}:dead"
WORKERS = f"{PREFIX}:workers"
ROUND_ROBIN = f"{PREFIX}:rr"

# The single field every stream entry carries: the pydantic message as JSON.
FIELD = "m"
# An inbox entry's other kind: a gateway's request that a worker put on another stream (a hand-back to
# kvfleet:req:any, a forward), as JSON [request id, stream, entry id], so its relay follows it there.
MOVED_FIELD = "moved"


def req_stream(worker_id: str) -> str:
    return f"{PREFIX}:req:{worker_id}"


def out_stream(request_id: str) -> str:
    return f"{PREFIX}:out:{request_id}"


def inbox(gateway_id: str) -> str:
    return f"{PREFIX}:inbox:{gateway_id}"


def status(worker_id: str) -> str:
    return f"{PREFIX}:status:{worker_id}"


def reserved(worker_id: str) -> str:
    return f"{PREFIX}:reserved:{worker_id}"


def cancelled(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def lease(request_id: str) -> str:
    return f"{PREFIX}:lease:{request_id}"


def job(request_id: str) -> str:
    return f"{PREFIX}:job:{request_id}"


def prefix_block(block_hash: str) -> str:
    return f"{PREFIX}:prefix:{block_hash}"


def validate_worker_id(worker_id: str) -> str:
    """Worker ids become part of key names: keep them to a safe alphabet."""
    if not worker_id or worker_id == "any" or any(not (c.isalnum() or c in "-_.") for c in worker_id):
        raise ValueError(f"worker id must be letters, digits, '-', '_' or '.', and not 'any'; got {worker_id!r}")
    return worker_id
