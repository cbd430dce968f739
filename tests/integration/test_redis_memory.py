"""What the chaos soak reads as Redis's memory after its load (streams.used_memory(keys_only=True)): the keys'
share, not the buffers of the connections open at the time (each ~17-50 KiB in used_memory), which a fleet's
connection pools hold however little data is left. A real Redis, with connections really opened."""

from __future__ import annotations

import time

import pytest
import redis

from shared import streams

pytestmark = pytest.mark.integration


def test_open_connections_are_not_counted_as_data(redis_url):
    r = streams.connect(redis_url)
    r.flushdb()
    idle = streams.used_memory(r, keys_only=True)
    clients = [redis.Redis.from_url(redis_url) for _ in range(60)]
    try:
        for c in clients:
            c.ping()
        deadline = time.monotonic() + 10
        while True:  # the per-client figures are updated by Redis's cron, a client at a time over about a second
            total, data = streams.used_memory(r), streams.used_memory(r, keys_only=True)
            if data - idle < 256 * 1024 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert total - idle > 60 * 10 * 1024  # the connections do hold memory ...
        assert data - idle < 256 * 1024  # ... that is not the keys'
        r.set("big", "x" * 2**20)  # while data is: a big value ...
        assert streams.used_memory(r, keys_only=True) - data > 2**20
        pipe = r.pipeline(transaction=False)
        for i in range(20_000):  # ... and many small keys left behind (a leak of marks or leases)
            pipe.set(f"kvfleet:cancelled:leak-{i}", 1, ex=60)
        pipe.execute()
        assert streams.used_memory(r, keys_only=True) - data > 2**20 + 512 * 1024
    finally:
        for c in clients:
            c.close()
        r.flushdb()
        r.close()
