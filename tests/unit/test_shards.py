"""Shards of the fleet's keys (shared.keys): where a worker lives, and that every atomic step (each Lua script,
each MULTI, each multi-key read) touches keys of one Redis Cluster slot only, for any shard. A fake client
records the keys of each step; redis-py's own CRC16 gives their slots."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.crc import key_slot

from shared import keys, streams
from shared.messages import GenerationRequest, OutputChunk, WorkerStatus
from shared.streams import flush
from shared.streams.worker import Ack


def slots(names: list[str]) -> set[int]:
    return {key_slot(n.encode()) for n in names}


class Pipe:
    def __init__(self, steps: list[list[str]], transaction: bool):
        self.steps, self.transaction, self.names, self.n = steps, transaction, [], 0

    def __getattr__(self, command: str):
        def queue(name: str, *args: Any, **kw: Any) -> None:
            self.names.append(name)
            self.n += 1
        return queue

    def execute(self) -> list[str]:
        if self.transaction:
            self.steps.append(self.names)
        return ["1-0"] * self.n


class Recorder:
    """A stand-in Redis client: each script run, MULTI and MGET is one step, its keys recorded."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def evalsha(self, sha: str, n: int, *args: Any) -> list:
        self.steps.append(list(args[:n]))
        return [[], []] if sha == flush._FLUSH.sha else []  # the full flush answers (refused, skipped)

    def pipeline(self, transaction: bool) -> Pipe:
        return Pipe(self.steps, transaction)

    def mget(self, names: list[str]) -> list[None]:
        self.steps.append(list(names))
        return [None] * len(names)

    def smembers(self, _name: str) -> set[str]:
        return {"w2", "w6"}

    def xadd(self, name: str, *_: Any, **__: Any) -> str:
        self.steps.append([name])
        return "1-0"


class AsyncRecorder(Recorder):
    async def evalsha(self, _sha: str, n: int, *args: Any) -> list:  # type: ignore[override]
        return super().evalsha(_sha, n, *args)

    async def mget(self, names: list[str]) -> list[None]:  # type: ignore[override]
        return super().mget(names)


def test_a_worker_lives_in_the_shard_its_trailing_number_names():
    assert [keys.shard_of(f"w{i}", 4) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert keys.shard_of("kvfleet-worker-7", 3) == 1 and keys.shard_of("host-8000-w5", 4) == 1
    named = keys.shard_of("kvfleet-worker-5d8f-abc", 16)
    assert named == keys.shard_of("kvfleet-worker-5d8f-abc", 16) and 0 <= named < 16  # CRC32: stable
    assert {keys.shard_of(w, 1) for w in ("w3", "abc", "x-99")} == {0}
    assert keys.stream_shard(keys.req_stream("w3", 7)) == 7 and keys.stream_shard(keys.req_any(12)) == 12


def test_cluster_urls():
    assert streams.cluster_url("redis+cluster://:pw@10.0.0.1:7000") == "redis://:pw@10.0.0.1:7000"
    assert streams.cluster_url("rediss+cluster://h:7000") == "rediss://h:7000"
    assert streams.cluster_url("redis://h:6379/0") is None


@pytest.mark.parametrize("shard", [0, 1, 5, 11])
def test_every_atomic_step_of_a_worker_touches_one_slot(shard):
    r = Recorder()
    own, shared = keys.req_stream("w5", shard), keys.req_any(shard)
    mine, taken_shared = Ack(own, "1-0", 1), Ack(shared, "2-0", 2)
    handed = GenerationRequest(request_id="h", prompt_token_ids=[1], reply_to="gw-b")
    status = WorkerStatus(worker_id="w5", model="m", max_model_len=8, block_size=16, total_blocks=4,
                          free_blocks=4, shard=shard)
    streams.publish(r, "w5", output_ttl_s=60, shard=shard, status=status, status_ttl_s=5, taken=["a"],
                    chunks=[OutputChunk(request_id="a", seq=0), OutputChunk(request_id="b", seq=0, final=True)],
                    reply_to={"a": "gw-a"}, owners={"a": mine, "b": taken_shared}, acks=[taken_shared],
                    requeued=[(handed, Ack(own, "3-0", 1))], held=[mine, taken_shared])
    fenced = len(r.steps)
    streams.publish(r, "w5", output_ttl_s=60, shard=shard, status=status, status_ttl_s=5, taken=["a"], run_id="run",
                    chunks=[OutputChunk(request_id="a", seq=1), OutputChunk(request_id="b", seq=1, final=True)],
                    reply_to={"a": "gw-a"}, owners={"a": mine, "b": taken_shared}, acks=[taken_shared])
    assert len(r.steps) == fenced + 1  # the fence held (the stand-in says so): one script, _FLUSH_FENCED
    assert {keys.inbox("gw-a", shard), keys.out_stream("b", shard), shared} <= set(r.steps[-1])
    streams.forward(r, handed.model_copy(update={"kv_blocks": 3}), "w9", mine, shard)
    streams.prune_dead_worker(r, "w1", shard)
    streams.leases_alive(r, ["a", "b"], shard)
    streams.other_workers(r, "w5", shard)
    streams.enqueue(r, GenerationRequest(request_id="e", prompt_token_ids=[1], kv_blocks=2), "w5", shard)
    streams.ack_and_delete(r, mine)
    assert len(r.steps) >= 7
    for step in r.steps:
        assert len(slots(step)) == 1, f"a step spans slots: {step}"
        assert all(f"{{s{shard}}}" in name for name in step), step


@pytest.mark.parametrize("shard", [0, 3])
def test_every_atomic_step_of_a_gateway_touches_one_slot(shard):
    r = AsyncRecorder()
    request = GenerationRequest(request_id="g", prompt_token_ids=[1, 2], kv_blocks=1, reply_to="gw")
    hashes = ["h0", "h1", "h2"]

    async def go() -> None:
        await streams.aenqueue_routed(r, request, "w3", shard, min_headroom=2, lease_ttl_s=10)
        await streams.aenqueue_shared(r, request, shard, bound=64, lease_ttl_s=10)
        await streams.aremember_prefix(r, hashes, "w3")
        await streams.aprefix_owners(r, hashes)

    asyncio.run(go())
    assert len(r.steps) == 4
    for step in r.steps:
        assert len(slots(step)) == 1, f"a step spans slots: {step}"


def test_shards_have_their_own_slots():
    assert len(slots([keys.req_any(k) for k in range(16)])) == 16
    assert len(slots([keys.status("w", 0), keys.lease("r", 0), keys.enqueued("r", 0), keys.inbox("g", 0),
                      keys.out_stream("r", 0), keys.workers(0), keys.reserved("w", 0)])) == 1


def test_celery_refuses_a_redis_cluster_broker_by_name():
    from celery import Celery

    from services.celery_app import configure
    from shared.settings import Settings

    with pytest.raises(ValueError, match="KVFLEET_CELERY_BROKER_URL is a Redis Cluster.*plain redis://") as e:
        configure(Celery("t"), Settings(redis_url="redis+cluster://:secret@10.0.0.1:7000"))
    assert "secret" not in str(e.value)
    configure(Celery("t"), Settings(redis_url="redis+cluster://10.0.0.1:7000",
                                    celery_broker_url="redis://10.0.0.2:6379/1"))  # a broker of its own: fine
