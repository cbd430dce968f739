"""A gateway's Redis client (streams.connect_async with max_connections): more blocking reads at once than
connections wait for a free one instead of failing with "Too many connections" (redis-py's default pool
fails past 100 concurrent commands, which 128 streams through one gateway reached)."""

from __future__ import annotations

import asyncio

import pytest

from shared import streams

pytestmark = pytest.mark.integration


def test_more_blocking_reads_than_connections_all_complete(redis_url):
    async def main() -> list:
        r = streams.connect_async(redis_url, max_connections=4)
        try:
            reads = [r.xread({f"pool-test-{i}": "$"}, block=200) for i in range(20)]
            return [await asyncio.wait_for(asyncio.gather(*reads), 30), r.connection_pool.max_connections]
        finally:
            await r.aclose()

    results, max_connections = asyncio.run(main())
    assert max_connections == 4
    assert len(results) == 20 and all(not x for x in results)  # every read timed out empty, none failed
