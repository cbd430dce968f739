"""Operations on the Redis server itself, for fault injection and checks (`kvfleet chaos`): drop every client
connection, read how much memory the server uses; and its work counters (`kvfleet bench serve --redis-stats`)."""

from __future__ import annotations

import redis


def kill_clients(r: redis.Redis) -> int:
    """Drop every normal client connection but this one (CLIENT KILL TYPE normal SKIPME yes): each kvfleet
    process meets a dropped connection on its next command. Returns how many were dropped."""
    return int(r.client_kill_filter(_type="normal", skipme=True))


def used_memory(r: redis.Redis) -> int:
    """Bytes the server holds (INFO memory: used_memory)."""
    return int(r.info("memory")["used_memory"])


def work_counters(r: redis.Redis) -> dict[str, float]:
    """What the server did since it started: commands (calls summed over INFO commandstats; a script's own
    commands count too), usec (their usec summed, a script's counted in it and again for its commands), cpu_s
    (the process's user + system CPU), net_bytes (in + out), and `calls:NAME` per command."""
    stats, cpu, net = r.info("commandstats"), r.info("cpu"), r.info("stats")
    out = {"commands": sum(v["calls"] for v in stats.values()), "usec": sum(v["usec"] for v in stats.values()),
           "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
           "net_bytes": net["total_net_input_bytes"] + net["total_net_output_bytes"]}
    out.update({f"calls:{k.removeprefix('cmdstat_')}": v["calls"] for k, v in stats.items()})
    return out
