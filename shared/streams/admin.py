"""Operations on the Redis server itself, for fault injection and checks (`kvfleet chaos`): drop every client
connection, read how much memory the server uses."""

from __future__ import annotations

import redis


def kill_clients(r: redis.Redis) -> int:
    """Drop every normal client connection but this one (CLIENT KILL TYPE normal SKIPME yes): each kvfleet
    process meets a dropped connection on its next command. Returns how many were dropped."""
    return int(r.client_kill_filter(_type="normal", skipme=True))


def used_memory(r: redis.Redis) -> int:
    """Bytes the server holds (INFO memory: used_memory)."""
    return int(r.info("memory")["used_memory"])
