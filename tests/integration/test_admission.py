"""Admission is bounded for every routing policy, against a real Redis with fake worker statuses: each worker
takes requests until `worker_queue_bound` of them wait for it (untaken in its stream, plus its status'
`waiting`), then the shared stream takes `queue_bound` more, then the gateway answers 429 with Retry-After.
No stream grows past its bound; a request a worker takes frees a place."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.errors import APIError
from gateway.placement import Target, build_request, place
from gateway.prompts import Prompt
from gateway.router import POLICIES
from gateway.state import GatewayState
from gateway.tokenizer import Tokenizers
from shared import keys, streams
from shared.messages import WorkerStatus
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

            # w1 takes one entry (now running, pending in its group): there is room for one more on w1
            await r.xreadgroup(keys.GROUP, "w1", {keys.req_stream("w1"): ">"}, count=1)
            assert await one(100) == "w1"
            with pytest.raises(APIError):
                await one(101)
            assert await r.xlen(keys.req_stream("w1")) == 4
        finally:
            state.tokenizers.close()
            await r.aclose()

    asyncio.run(main())
