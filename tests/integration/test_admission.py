"""Admission is bounded for every routing policy, against a real Redis with fake worker statuses: each worker
takes requests until `worker_queue_bound` of them wait for it (reserved there and not yet counted by its status,
plus its status' `waiting`), then the shared stream takes `queue_bound` more, then the gateway answers 429 with Retry-After.
No stream grows past its bound; a request a worker takes frees a place."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.errors import APIError
from gateway.placement import build_request, place
from gateway.prompts import Prompt
from gateway.router import POLICIES
from gateway.state import GatewayState
from gateway.targets import Target
from gateway.tokenizer import Tokenizers
from shared import keys, streams
from shared.messages import GenerationRequest, WorkerStatus
from shared.sampling_params import SamplingParams
from shared.settings import Settings

pytestmark = pytest.mark.integration

WORKER_BOUND, SHARED_BOUND = 3, 2


def status(wid: str, waiting: int) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, model="tiny", max_model_len=4096, block_size=16, total_blocks=10_000,
                        free_blocks=10_000, waiting=waiting)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_stops_at_the_bound_and_answers_429(redis_url, policy):
    settings = Settings(redis_url=redis_url, routing=policy, worker_queue_bound=WORKER_BOUND,
                        queue_bound=SHARED_BOUND, retry_after_s=2)

    async def main() -> None:
        r = streams.connect_async(redis_url)
        state = GatewayState(settings=settings, redis=r, tokenizers=Tokenizers(1))
        try:
            await r.flushdb()
            workers = [status("w0", waiting=1), status("w1", waiting=0)]  # w0 already has one waiting
            await r.sadd(keys.workers(), "w0", "w1")
            for w in workers:
                await r.set(keys.status(w.worker_id), w.model_dump_json())
                await r.xgroup_create(keys.req_stream(w.worker_id), keys.GROUP, id="0", mkstream=True)
            view = await streams.aread_fleet(r)
            target = Target("tiny", workers, view, tokenizer=None, max_model_len=4096, block_size=16,
                            max_total_blocks=10_000)

            async def one(i: int) -> str | None:
                prompt = Prompt([1 + i % 50] * 20, None, SamplingParams(max_tokens=4))
                planned = build_request(settings, target, prompt, priority=0, request_id=f"{policy}-{i}")
                return (await place(state, planned)).placement.worker_id

            placed = []
            with pytest.raises(APIError) as refused:
                for i in range(50):
                    placed.append(await one(i))
            assert refused.value.status == 429 and refused.value.code == "fleet_overloaded"
            assert refused.value.headers == {"Retry-After": "2"}
            assert "fewer than 3 requests waiting" in refused.value.message
            # w0: 3 less the 1 it reported waiting; w1: 3; the shared stream: 2
            assert Counter(placed) == {"w0": 2, "w1": 3, None: 2}, placed
            lengths = [await r.xlen(keys.req_stream("w0")), await r.xlen(keys.req_stream("w1")),
                       await r.xlen(keys.req_any())]
            assert lengths == [2, 3, 2]

            # w1 takes one entry: until its status counts the request, it still waits there (reserved)
            [(_, [(_, fields)])] = await r.xreadgroup(keys.GROUP, "w1", {keys.req_stream("w1"): ">"}, count=1)
            with pytest.raises(APIError):
                await one(99)
            # its next status counts it as running (the status flush deletes its reservation): room for one more
            await r.hdel(keys.reserved("w1"), streams.parse_request(fields).request_id)
            assert await one(100) == "w1"
            with pytest.raises(APIError):
                await one(101)
            assert await r.xlen(keys.req_stream("w1")) == 4
        finally:
            state.tokenizers.close()
            await r.aclose()

    asyncio.run(main())


def test_a_routed_enqueue_costs_seven_commands_and_pushes_the_reservations_expiry_only_when_asked(redis_url):
    """The enqueue script reads the status and the reservations once for both checks (no XLEN or XPENDING of
    the stream), reads the lease (a GET: whether this same call ran before, its reply lost), and pushes the
    reservations' expiry out only at the hash's creation or when asked."""

    async def main() -> None:
        r = streams.connect_async(redis_url)
        try:
            await r.flushdb()
            await r.set(keys.status("w0"), status("w0", waiting=0).model_dump_json())
            await r.xgroup_create(keys.req_stream("w0"), keys.GROUP, id="0", mkstream=True)

            async def enqueue(i: int, push: bool) -> str | None:
                request = GenerationRequest(request_id=f"r{i}", prompt_token_ids=[1] * 20, kv_blocks=2,
                                            sampling_params=SamplingParams(max_tokens=4).to_dict())
                return await streams.aenqueue_routed(r, request, "w0", 0, min_headroom=2, queue_bound=8,
                                                     reservation_ttl_s=30, lease_ttl_s=10, push_expiry=push)

            assert await enqueue(0, push=False)  # a new hash: its expiry is set anyway
            assert 25_000 < await r.pttl(keys.reserved("w0")) <= 30_000
            await r.pexpire(keys.reserved("w0"), 5_000)
            before = {k: v["calls"] for k, v in (await r.info("commandstats")).items()}
            assert await enqueue(1, push=False)
            after = {k: v["calls"] for k, v in (await r.info("commandstats")).items()}
            spent = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            spent.pop("cmdstat_info", None)
            assert spent == {f"cmdstat_{c}": 1 for c in ("evalsha", "hvals", "hset", "set", "xadd")} | {
                "cmdstat_get": 2}, spent  # the status and the lease
            assert await r.pttl(keys.reserved("w0")) <= 5_000  # not pushed
            assert await enqueue(2, push=True)
            assert await r.pttl(keys.reserved("w0")) > 25_000
            assert await r.hgetall(keys.reserved("w0")) == {"r0": "2", "r1": "2", "r2": "2"}
            assert await r.xlen(keys.req_stream("w0")) == 3
        finally:
            await r.aclose()

    asyncio.run(main())


def test_a_routed_enqueue_takes_a_request_while_free_less_promised_less_reserved_blocks_leave_the_headroom(
        redis_url):
    """The script reads free_blocks, promised_blocks and waiting out of the status JSON (wherever they stand in
    it, negative too) and refuses exactly at the edge: free - promised - reserved - this request < headroom."""

    async def main() -> None:
        r = streams.connect_async(redis_url)
        try:
            await r.flushdb()
            worker = WorkerStatus(worker_id="w0", model="tiny", model_path='/m/"free_blocks":999', max_model_len=4096,
                                  block_size=16, total_blocks=100, free_blocks=50, promised_blocks=20, waiting=1)
            await r.set(keys.status("w0"), worker.model_dump_json())

            async def enqueue(i: int, blocks: int, bound: int = 8) -> str | None:
                request = GenerationRequest(request_id=f"h{i}", prompt_token_ids=[1] * 20, kv_blocks=blocks,
                                            sampling_params=SamplingParams(max_tokens=4).to_dict())
                return await streams.aenqueue_routed(r, request, "w0", 0, min_headroom=4, queue_bound=bound)

            assert await enqueue(0, blocks=10)  # 50 - 20 - 0 - 10 = 20 >= 4
            assert await enqueue(1, blocks=16)  # 50 - 20 - 10 - 16 = 4: the edge, taken
            assert await enqueue(2, blocks=1) is None  # 50 - 20 - 26 - 1 = 3 < 4
            assert await enqueue(3, blocks=0, bound=3) is None  # 2 reserved + 1 waiting = the bound of 3
            await r.set(keys.status("w0"), worker.model_copy(update={"promised_blocks": -5}).model_dump_json())
            assert await enqueue(4, blocks=1)  # 50 + 5 - 26 - 1 = 28
            assert await r.hgetall(keys.reserved("w0")) == {"h0": "10", "h1": "16", "h4": "1"}
        finally:
            await r.aclose()

    asyncio.run(main())
