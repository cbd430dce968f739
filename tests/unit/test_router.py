"""The router is a pure function: exact picks for small fleets."""

from __future__ import annotations

import pytest

from gateway.router import headroom, prefix_overlap, route
from shared.blocks import block_hashes, blocks_for, request_blocks
from shared.messages import WorkerStatus

pytestmark = pytest.mark.unit


def ws(wid: str, free: int, total: int = 100, *, promised: int = 0, running: int = 0, waiting: int = 0,
       draining: bool = False) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, model="m", max_model_len=2048, block_size=16, total_blocks=total,
                        free_blocks=free, promised_blocks=promised, running=running, waiting=waiting,
                        draining=draining)


def test_free_blocks_picks_most_headroom():
    fleet = [ws("a", 30), ws("b", 80), ws("c", 50)]
    assert route(10, fleet, "free_blocks", {}) == "b"


def test_free_blocks_counts_reservations_and_promised_blocks():
    fleet = [ws("a", 60), ws("b", 80, promised=15), ws("c", 70)]
    # b: 80 - 15 - 10 = 55 ; a: 60 - 10 = 50 ; c: 70 - 20 - 10 = 40
    assert route(10, fleet, "free_blocks", {"c": 20}) == "b"
    assert route(10, fleet, "free_blocks", {"c": 20, "b": 10}) == "a"


def test_free_blocks_requires_reserve_and_returns_none_when_nothing_fits():
    fleet = [ws("a", 12), ws("b", 11)]
    assert route(10, fleet, "free_blocks", {}, reserve_blocks=2) == "a"
    assert route(10, fleet, "free_blocks", {}, reserve_blocks=3) is None
    assert route(10, fleet, "free_blocks", {"a": 1}, reserve_blocks=2) is None


def test_a_burst_spreads_over_workers_through_reservations():
    fleet = [ws("big", 100), ws("small", 40)]
    reservations: dict[str, int] = {}
    picks = []
    for _ in range(20):
        w = route(10, fleet, "free_blocks", reservations, reserve_blocks=2)
        if w is None:
            break
        picks.append(w)
        reservations[w] = reservations.get(w, 0) + 10
    # big takes requests until its headroom falls to small's, then they alternate; both end full.
    assert picks.count("big") > picks.count("small") > 0
    assert reservations["big"] <= 100 - 2 and reservations["small"] <= 40 - 2
    assert route(10, fleet, "free_blocks", reservations, reserve_blocks=2) is None


@pytest.mark.parametrize("policy", ["free_blocks", "prefix", "least_loaded", "round_robin"])
def test_never_routes_to_a_worker_that_cannot_hold_the_request(policy):
    fleet = [ws("tiny", 20, total=20), ws("big", 30, total=200, running=9)]
    for turn in range(4):
        assert route(25, fleet, policy, {}, turn=turn) == "big"
    assert route(300, fleet, policy, {}) is None


@pytest.mark.parametrize("policy", ["free_blocks", "prefix", "least_loaded", "round_robin"])
def test_draining_workers_get_nothing(policy):
    fleet = [ws("a", 90, draining=True), ws("b", 20)]
    assert route(5, fleet, policy, {}) == "b"
    assert route(5, [ws("a", 90, draining=True)], policy, {}) is None


def test_round_robin_cycles_in_id_order_ignoring_free_blocks():
    fleet = [ws("c", 5), ws("a", 90), ws("b", 1)]
    assert [route(4, fleet, "round_robin", {}, turn=t) for t in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_counts_requests():
    fleet = [ws("a", 90, running=5, waiting=2), ws("b", 10, running=3, waiting=3), ws("c", 50, running=8)]
    assert route(4, fleet, "least_loaded", {}) == "b"


def test_prefix_prefers_cached_prefix_against_load():
    fleet = [ws("a", 60), ws("b", 90)]
    # 20 prompt blocks: a holds 15 of them (cost 5 + 40 in use = 45) vs b (20 + 10 = 30): b still wins.
    assert route(22, fleet, "prefix", {}, prompt_blocks=20, prefix_overlap={"a": 15}) == "b"
    # with prefill weighted 4x: a = 4*5 + 40 = 60 < b = 4*20 + 10 = 90.
    assert route(22, fleet, "prefix", {}, prompt_blocks=20, prefix_overlap={"a": 15}, prefill_weight=4) == "a"
    # but never where it does not fit
    assert route(22, [ws("a", 21), ws("b", 90)], "prefix", {}, prompt_blocks=20, prefix_overlap={"a": 20},
                 prefill_weight=100) == "b"


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="round_robin"):
        route(1, [ws("a", 9)], "random", {})


def test_block_arithmetic():
    assert blocks_for(0, 16) == 0 and blocks_for(1, 16) == 1 and blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2
    assert request_blocks(20, 12, 1, 16) == 2
    # n=3: one shared full prompt block; each choice holds 4 tail tokens + 30 output -> 3 blocks
    assert request_blocks(20, 30, 3, 16) == 1 + 3 * 3
    assert headroom(ws("a", 50, promised=5), 10, {"a": 7}) == 28


def test_prefix_hashes_chain_and_overlap_counts_leading_blocks():
    a = block_hashes(list(range(40)), 16, "m")  # 2 full blocks; the 8-token tail is not hashed
    b = block_hashes(list(range(32)) + [99] * 20, 16, "m")
    c = block_hashes([7] + list(range(1, 40)), 16, "m")
    assert len(a) == 2 and b[:2] == a and len(b) == 3
    assert not set(c) & set(a)  # a block's hash covers every token before it
    assert block_hashes(list(range(40)), 16, "other-model") != a
    # the workers each of b's blocks was last routed to (shared.streams.aprefix_owners): a to w1, then b[2:] to w2
    # block 3's hash chains blocks 1-2, so the request that took it to w2 took them there too
    assert prefix_overlap([["w1"], ["w2", "w1"], ["w2"]]) == {"w1": 2, "w2": 3}
    assert prefix_overlap([["w1"], [], ["w1"]]) == {"w1": 3}
    assert prefix_overlap([[], []]) == {} and prefix_overlap([]) == {}
    # a hot prompt that went to w1, then (w1 full) to w3: both hold it, both are credited
    assert prefix_overlap([["w3", "w1"], ["w3", "w1"]]) == {"w1": 2, "w3": 2}


def test_a_chat_turn_goes_back_to_the_worker_holding_the_conversation():
    """A chat's first blocks are its system prompt's, last routed to wherever another chat on it went (a); its
    deeper blocks were last routed to b, which therefore holds the whole conversation so far."""
    owners = [["a"]] * 8 + [["b"]] * 12 + [[]] * 4  # 24 prompt blocks, the last 4 (the new message) nowhere yet
    overlap = prefix_overlap(owners)
    assert overlap == {"a": 8, "b": 20}
    fleet = [ws("a", 90), ws("b", 80), ws("c", 95)]
    assert route(30, fleet, "prefix", {}, prompt_blocks=24, prefix_overlap=overlap, prefill_weight=16) == "b"


def test_prefix_weight_trades_cached_blocks_against_blocks_in_use():
    fleet = [ws("a", 40), ws("b", 90)]  # a: 60 blocks in use and the prompt's 10 blocks; b: 10 in use, none
    for weight, pick in ((1, "b"), (4, "b"), (6, "a"), (16, "a")):  # a: 60 vs b: 10 + 10 * weight
        assert route(12, fleet, "prefix", {}, prompt_blocks=10, prefix_overlap={"a": 10}, prefill_weight=weight) == pick


def test_affinity_slack_keeps_a_large_weight_off_an_overloaded_worker():
    fleet = [ws("a", 90, running=40, waiting=3), ws("b", 90, running=10), ws("c", 95, running=12)]
    kw = dict(prompt_blocks=20, prefix_overlap={"a": 20}, prefill_weight=64)
    assert route(22, fleet, "prefix", {}, **kw) == "a"  # no bound: the cache wins whatever a's queue
    assert route(22, fleet, "prefix", {}, affinity_slack=33, **kw) == "a"  # a: 43 requests <= 10 + 33
    # a is 33 requests past b: out; of b and c, the fewer blocks in use (c) wins, the cache no longer counts
    assert route(22, fleet, "prefix", {}, affinity_slack=32, **kw) == "c"
    assert route(22, fleet, "prefix", {}, affinity_slack=0, **kw) == "b"  # only the least loaded is left
