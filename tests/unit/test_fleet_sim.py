"""The fleet simulator (services.bench.fleet_sim): exact timings of a tiny run, worked out by hand from the
cost model; policies that differ as they should; the same seed giving the same report."""

from __future__ import annotations

import random

import pytest

from gpu_worker.executor.cost_model import CostProfile, sim_token
from services.bench.fleet_sim import FleetSim
from services.bench.fleet_sim_report import format_table, summarize
from services.bench.fleet_sim_workloads import VOCAB_SIZE, SimRequest, generate

pytestmark = pytest.mark.unit

TINY = CostProfile("tiny", a_s=0.01, b_s_per_prefill_token=0.001, c_s_per_decode_seq=0.002,
                   d_s_per_context_token=0.0, num_kv_blocks=64, block_size=16, max_num_seqs=8,
                   max_num_batched_tokens=2048)


@pytest.mark.parametrize("policy", ["free_blocks", "round_robin"])
def test_tiny_run_has_the_timings_the_cost_model_implies(policy):
    # r0: 10 prompt tokens, 3 out, sent at 0; r1: 20 prompt tokens, 2 out, sent at 0.005 (the worker is busy).
    reqs = [SimRequest("r0", 0.0, list(range(100, 110)), 3, "x"),
            SimRequest("r1", 0.005, list(range(200, 220)), 2, "x")]
    run = FleetSim(policy, TINY, 1).run(reqs)
    r0, r1 = run.traces
    # step 1 [0, 0.020]: r0's prefill, 10 tokens: 0.01 + 0.001 * 10 = 0.020 -> r0's first token
    # step 2 [0.020, 0.052]: r1's prefill (20 tokens, read while step 1 ran) + r0's decode:
    #        0.01 + 0.001 * 20 + 0.002 * 1 = 0.032 -> r0's 2nd token, r1's first
    # step 3 [0.052, 0.066]: two decodes: 0.01 + 0.002 * 2 = 0.014 -> r0's 3rd (done), r1's 2nd (done)
    assert r0.token_times == pytest.approx([0.020, 0.052, 0.066])
    assert r1.token_times == pytest.approx([0.052, 0.066])
    assert (r0.finish_s, r1.finish_s) == pytest.approx((0.066, 0.066))
    s = summarize(run)
    assert s["p50_ttft_s"] == pytest.approx((0.020 + 0.047) / 2)  # r1 was sent at 0.005
    assert s["p99_e2e_s"] == pytest.approx(0.061 + (0.066 - 0.061) * 0.99)
    assert s["mean_tpot_s"] == pytest.approx(((0.066 - 0.020) / 2 + 0.014) / 2)
    assert sorted([s["p50_itl_s"], s["p99_itl_s"]]) == pytest.approx(sorted([0.014, 0.014 + (0.032 - 0.014) * 0.98]))
    assert s["output_throughput"] == pytest.approx(5 / 0.066)
    assert s["preemptions"] == 0 and s["sim_steps"] == 3
    assert s["prefix_cache_hit_rate"] == 0.0


def test_a_shared_prefix_hits_the_real_prefix_cache():
    """Two requests on one 32-token prefix, the second after the first finished: its two full blocks hit."""
    prefix = list(range(1000, 1032))
    reqs = [SimRequest("a", 0.0, prefix + [5, 6, 7], 2, "x"), SimRequest("b", 1.0, prefix + [8, 9], 2, "x")]
    run = FleetSim("prefix", TINY, 1).run(reqs)
    assert [t.cached_tokens for t in run.traces] == [0, 32]
    # b's prefill is its 2 uncached tokens: 0.01 + 0.001 * 2
    assert run.traces[1].token_times[0] - 1.0 == pytest.approx(0.012)


def test_a_chat_turn_extends_the_previous_turn_with_the_simulated_reply():
    reqs = generate("shared-prefix", rate=50.0, seed=3, num_requests=400)
    by_id = {r.request_id: r for r in reqs}
    turns = [r for r in reqs if r.after is not None]
    assert turns, "the workload has multi-turn chats"
    for r in turns[:20]:
        prev = by_id[r.after]
        reply = [sim_token(0, prev.request_id, i, VOCAB_SIZE) for i in range(prev.output_len)]
        assert r.prompt[:len(prev.prompt) + prev.output_len] == prev.prompt + reply
        assert r.arrival_s > prev.arrival_s


SMALL_CACHE = CostProfile("small", a_s=0.005, b_s_per_prefill_token=1e-3, c_s_per_decode_seq=1e-4,
                          d_s_per_context_token=0.0, num_kv_blocks=160, block_size=16, max_num_seqs=32,
                          max_num_batched_tokens=2048)


def _system_prompt_load(n=200, rate=10.0, seed=0):
    """Users over 8 system prompts of 512 tokens (32 blocks each; a worker's 160 blocks hold about four)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, VOCAB_SIZE) for _ in range(512)] for _ in range(8)]
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(f"r{i}", t, rng.choice(systems) + [rng.randrange(100, VOCAB_SIZE) for _ in range(16)],
                               16, "system"))
    return reqs


def test_prefix_routing_hits_the_cache_more_than_round_robin():
    """Round robin spreads every system prompt over every worker, whose caches then evict one another's;
    prefix routing sends a prompt back to the worker it last went to."""
    reqs = _system_prompt_load()
    s = {p: summarize(FleetSim(p, SMALL_CACHE, 4).run(reqs)) for p in ("round_robin", "prefix")}
    assert s["prefix"]["prefix_cache_hit_rate"] > s["round_robin"]["prefix_cache_hit_rate"] + 0.05
    assert s["prefix"]["p90_ttft_s"] < s["round_robin"]["p90_ttft_s"]


def test_the_same_seed_gives_the_same_report():
    def report(seed):
        reqs = generate("shared-prefix", rate=4.0, seed=seed, num_requests=60)
        s = summarize(FleetSim("free_blocks", TINY_FLEET, 3).run(reqs))
        return {k: v for k, v in s.items() if k not in ("sim_wall_s", "sim_cpu_s")}

    first, again, other = report(0), report(0), report(1)
    assert first == again
    assert first != other


TINY_FLEET = CostProfile("tiny-fleet", a_s=0.005, b_s_per_prefill_token=1e-4, c_s_per_decode_seq=1e-4,
                         d_s_per_context_token=1e-8, num_kv_blocks=1024, block_size=16, max_num_seqs=32,
                         max_num_batched_tokens=2048)


def test_a_request_larger_than_a_workers_cache_is_refused_up_front():
    reqs = [SimRequest("big", 0.0, list(range(100, 100 + 161 * 16)), 4, "x")]
    with pytest.raises(ValueError, match="big.*KV blocks"):
        FleetSim("free_blocks", SMALL_CACHE, 2).run(reqs)


def test_the_table_has_one_column_per_policy():
    reqs = _system_prompt_load(n=20)
    summaries = [summarize(FleetSim(p, SMALL_CACHE, 2).run(reqs)) for p in ("least_loaded", "free_blocks")]
    table = format_table(summaries, "header")
    assert table.splitlines()[1].split() == ["least_loaded", "free_blocks"]
    assert "TTFT p90 (ms)" in table and "prefix-cache hit rate" in table


def test_the_command_writes_json_and_charts(tmp_path, capsys):
    import argparse
    import json

    from services.bench import fleet_sim_cmd

    profile = tmp_path / "tiny.json"
    TINY_FLEET.save(profile)
    parser = argparse.ArgumentParser()
    fleet_sim_cmd.add_parser(parser.add_subparsers(dest="bench"))
    out = tmp_path / "sim.json"
    args = parser.parse_args(["fleet-sim", "--workers", "2", "--rate", "4", "--num-requests", "30", "--profile",
                              str(profile), "--policies", "round_robin,prefix", "--json", str(out), "--no-progress"])
    assert fleet_sim_cmd.run(args) == 0
    report = json.loads(out.read_text())
    assert [p["policy"] for p in report["policies"]] == ["round_robin", "prefix"]
    assert all(p["requests"] == 30 and p["p90_ttft_s"] > 0 for p in report["policies"])
    assert "<svg" in out.with_suffix(".html").read_text()
    assert "prefix-cache hit rate" in capsys.readouterr().out



def test_a_bench_workload_replays_bench_serves_requests_and_arrivals():
    """--workload shared_prefix: the same requests and Poisson arrival times `kvfleet bench serve` sends at the
    same rate and seed, so a simulated run can be set against a real one."""
    from services.bench.fleet_sim_workloads import VOCAB_SIZE, from_bench_workload
    from services.bench.stats import poisson_arrivals
    from services.bench.workload import load_workload

    sim = from_bench_workload("shared_prefix", rate=1.5, seed=3, num_requests=20)
    real = load_workload("shared_prefix", vocab_size=VOCAB_SIZE, num_requests=20, seed=3).requests
    assert [s.prompt for s in sim] == [r.prompt_token_ids for r in real]
    assert [s.output_len for s in sim] == [r.output_len for r in real]
    assert [s.arrival_s for s in sim] == poisson_arrivals(20, 1.5, 3)
