"""Routing by free KV blocks on a fleet of two very different workers (160 vs 40 blocks of 4 tokens): under load the
router sends more to the larger, nothing to a worker whose whole cache cannot hold the request, and the
fleet preempts less than with round_robin on the same load (both counts printed)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fleet_harness import Fleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIG, SMALL = 160, 40
BLOCK = 4  # small blocks: little compute per request, yet caches that fill up
PROMPT_LENS = [16, 40, 80, 120, 170]  # 170 + 32 output tokens = 51 blocks: more than SMALL holds
MAX_TOKENS = 32
N_REQUESTS = 30


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("fleet-routing")) as f:
        common = ["--max-num-seqs", "32", "--no-enable-prefix-caching", "--block-size", str(BLOCK)]
        f.start_worker("big", "--num-kv-blocks", str(BIG), *common)
        f.start_worker("small", "--num-kv-blocks", str(SMALL), *common)
        f.ports = {policy: f.start_gateway("--routing", policy) for policy in ("free_blocks", "round_robin")}
        f.wait_ready(workers=2)
        yield f


def _load(seed: int) -> list[list[int]]:
    """The same shape of load for each policy: prompt lengths cycle, tokens are fresh (no shared prefixes)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])]
            for i in range(N_REQUESTS)]


def _counts(workers: list[dict]) -> dict[str, int]:
    return {"preemptions": sum(w["num_preemptions"] for w in workers)} | {
        w["worker_id"]: w["num_finished"] for w in workers}


def _run(fleet: Fleet, policy: str, prompts: list[list[int]]) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """Send the load at once; return (prompt length, routed-to) per request and what each worker served,
    with the preemptions."""
    port = fleet.ports[policy]
    before = _counts(fleet.fleet_status(port)["workers"])

    def post(prompt: list[int]) -> tuple[int, str]:
        body = {"model": fleet.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        with fleet.http(port, timeout=300) as h:
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
            return len(prompt), r.headers["x-kvfleet-worker"]

    with ThreadPoolExecutor(N_REQUESTS) as pool:
        routed = list(pool.map(post, prompts))

    def settled() -> dict[str, int] | None:
        # idle, and every answered request counted: a worker's status is its last heartbeat, which can show the
        # engine empty while the count of its last output is a heartbeat behind (a CI run read 29 of 30 so)
        workers = fleet.fleet_status(port)["workers"]
        counts = _counts(workers)
        idle = all(w["running"] == 0 and w["waiting"] == 0 for w in workers)
        served = sum(counts[w] - before.get(w, 0) for w in counts if w != "preemptions")
        return counts if idle and served >= len(prompts) else None

    after = fleet.wait_for(settled, what="the fleet to go idle with every answered request counted")
    return routed, {k: after[k] - before[k] for k in after}


def test_free_blocks_routing_beats_round_robin(fleet):
    t0 = time.monotonic()
    free_routed, free = _run(fleet, "free_blocks", _load(1))
    t1 = time.monotonic()
    rr_routed, rr = _run(fleet, "round_robin", _load(1 + 1000))
    print(f"\nfree_blocks run {t1 - t0:.1f}s, round_robin run {time.monotonic() - t1:.1f}s")
    routed = {policy: {w: sum(1 for _, x in r if x == w) for w in ("big", "small", "any")}
              for policy, r in (("free_blocks", free_routed), ("round_robin", rr_routed))}
    print(f"routed by the gateway (any = shared queue): {routed}")
    print(f"served: free_blocks big {free['big']} small {free['small']}; round_robin big {rr['big']} "
          f"small {rr['small']}")
    print(f"preemptions on the same load: free_blocks {free['preemptions']}, round_robin {rr['preemptions']}")
    assert free["big"] + free["small"] == rr["big"] + rr["small"] == N_REQUESTS
    too_big = -(-(max(PROMPT_LENS) + MAX_TOKENS) // BLOCK)
    assert too_big > SMALL
    for r in (free_routed, rr_routed):  # never routed where the whole cache cannot hold it
        assert not [n for n, w in r if w == "small" and -(-(n + MAX_TOKENS) // BLOCK) > SMALL]
    assert routed["free_blocks"]["big"] > routed["free_blocks"]["small"]
    assert free["big"] > free["small"] > 0
    assert free["preemptions"] < rr["preemptions"]
