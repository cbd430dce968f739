"""The benchmark's workload reading, FLOP counting and KV-waste math (no model, no torch)."""

import json
from pathlib import Path

import pytest

from services.bench.metrics import KVWasteMeter, ModelShape
from services.bench.workload import (
    BUNDLED_DIR,
    SEARCH_DIRS,
    SHARED_DIR,
    BenchRequest,
    Workload,
    load_workload,
    prompt_ids_for,
    resolve_workload_path,
)

pytestmark = pytest.mark.unit

SMOLLM2 = ModelShape(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, vocab_size=49152)


def _jsonl(tmp_path, rows):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_prompts_are_seeded_and_share_their_group_prefix(tmp_path):
    rows = [{"id": i, "prompt_len": 10 + i, "output_len": 3 + i, "prefix_group": i % 2, "prefix_len": 6,
             "arrival_s": 0.0} for i in range(4)]
    rows.append({"id": 4, "prompt_len": 5, "output_len": 1, "prefix_group": None, "prefix_len": 0, "arrival_s": 0})
    wl = load_workload(_jsonl(tmp_path, rows), vocab_size=100, seed=7)
    reqs = wl.requests
    assert [len(r.prompt_token_ids) for r in reqs] == [10, 11, 12, 13, 5]
    assert [r.output_len for r in reqs] == [3, 4, 5, 6, 1]
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert reqs[0].prompt_token_ids[:6] == reqs[2].prompt_token_ids[:6]  # group 0
    assert reqs[1].prompt_token_ids[:6] == reqs[3].prompt_token_ids[:6]  # group 1
    assert reqs[0].prompt_token_ids[:6] != reqs[1].prompt_token_ids[:6]
    assert reqs[0].prompt_token_ids[6:10] != reqs[2].prompt_token_ids[6:10]  # after the prefix: their own
    # same seed: same ids; another seed: other ids; the first N do not depend on N
    again = load_workload(_jsonl(tmp_path, rows), vocab_size=100, seed=7, num_requests=2)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in reqs[:2]]
    assert again.name == "w.jsonl (first 2)"
    other = load_workload(_jsonl(tmp_path, rows), vocab_size=100, seed=8)
    assert other.requests[0].prompt_token_ids != reqs[0].prompt_token_ids


def test_prompt_ids_prefix_never_longer_than_the_prompt():
    line = {"id": 3, "prompt_len": 4, "output_len": 1, "prefix_group": 0, "prefix_len": 512}
    assert len(prompt_ids_for(line, vocab_size=50, seed=0)) == 4


def test_peer_file_keeps_its_ids_and_output_len(tmp_path):
    data = {"model": "SET-ME", "output_len": 128,
            "requests": [{"id": 0, "prompt_token_ids": [1, 2, 3], "output_len": 128},
                         {"id": 1, "prompt_token_ids": [4, 5]}]}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps(data))
    wl = load_workload(path, vocab_size=10)
    assert [(r.id, r.prompt_token_ids, r.output_len) for r in wl.requests] == [(0, [1, 2, 3], 128), (1, [4, 5], 128)]
    assert wl.prompt_tokens == 5 and wl.output_tokens == 256
    peer = wl.to_peer_json("/models/x")
    assert peer["model"] == "/models/x" and peer["requests"][1] == {"id": 1, "prompt_token_ids": [4, 5],
                                                                     "output_len": 128}
    with pytest.raises(ValueError, match="outside the model's vocabulary of 4"):
        load_workload(path, vocab_size=4)


def test_names_resolve_in_the_shared_folders_then_the_bundled_copies():
    peer, sharegpt = resolve_workload_path("peer64"), resolve_workload_path("sharegpt_like")
    assert peer.name == "peer64.json" and peer.parent in SEARCH_DIRS
    assert sharegpt.name == "sharegpt_like.jsonl" and sharegpt.parent in SEARCH_DIRS
    if SHARED_DIR.is_dir():  # the team's reference copies win, and the bundled ones equal them
        assert peer == SHARED_DIR / "peers" / "peer64.json"
        assert sharegpt == SHARED_DIR / "workloads" / "sharegpt_like.jsonl"
    for name in ("peer64.json", "sharegpt_like.jsonl", "alpaca_like.jsonl", "shared_prefix.jsonl"):
        reference = next((d / name for d in SEARCH_DIRS[:2] if (d / name).is_file()), None)
        if reference is not None:
            assert (BUNDLED_DIR / name).read_bytes() == reference.read_bytes(), f"bundled {name} is stale"
    wl = load_workload("alpaca_like", vocab_size=SMOLLM2.vocab_size, num_requests=5)
    assert len(wl.requests) == 5 and wl.name == "alpaca_like.jsonl (first 5)"
    with pytest.raises(FileNotFoundError, match="no-such-workload"):
        resolve_workload_path("no-such-workload")
    with pytest.raises(ValueError, match="--num-requests"):
        load_workload("alpaca_like", vocab_size=100, num_requests=0)


def test_peer64_is_the_issue_workload():
    wl = load_workload("peer64", vocab_size=SMOLLM2.vocab_size)
    assert len(wl.requests) == 64 and wl.prompt_tokens == 16428 and wl.output_tokens == 64 * 128


def test_kv_waste_is_slot_time_weighted():
    meter = KVWasteMeter()
    meter.observe(used_blocks=2, allocated_slots=32, stored_tokens=24)  # 8 wasted
    meter.observe(used_blocks=4, allocated_slots=64, stored_tokens=64)  # none
    meter.observe(used_blocks=0, allocated_slots=0, stored_tokens=0)  # idle: not a sample
    assert meter.samples == 2
    assert meter.waste == pytest.approx(8 / 96)
    assert meter.peak_waste == pytest.approx(0.25) and meter.peak_used_blocks == 4
    with pytest.raises(AssertionError):
        meter.observe(used_blocks=1, allocated_slots=16, stored_tokens=17)


def test_flops_match_a_direct_count():
    s = SMOLLM2
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 576 * 3072 + 1536 * 576
    assert s.layer_linear_flops == 2 * 30 * per_layer
    assert s.lm_head_flops == 2 * 576 * 49152
    # positions 2, 3, 4 attend to 3, 4, 5 keys
    assert s.attention_flops(2, 3) == 4 * 9 * 64 * 30 * (3 + 4 + 5)
    prompt, out, cached = 10, 4, 3
    direct = sum(s.layer_linear_flops + 4 * 9 * 64 * 30 * (pos + 1) for pos in range(cached, prompt + out - 1))
    assert s.request_flops(prompt, out, cached) == direct + out * s.lm_head_flops



def test_with_lengths_sets_every_output_and_cuts_every_prompt_and_names_a_bad_flag():
    wl = Workload(name="w", path=Path("w.json"),
                  requests=[BenchRequest(0, [1, 2, 3, 4], 8), BenchRequest(1, [5, 6], 16)])
    prefill_only = wl.with_lengths(output_len=1)
    assert [r.output_len for r in prefill_only.requests] == [1, 1] and prefill_only.prompt_tokens == 6
    assert prefill_only.name == "w, 1 output tokens each"
    decode_heavy = wl.with_lengths(output_len=256, prompt_len=3)
    assert [r.prompt_token_ids for r in decode_heavy.requests] == [[1, 2, 3], [5, 6]]
    assert decode_heavy.output_tokens == 512 and "prompts cut to 3 tokens" in decode_heavy.name
    assert wl.with_lengths() == wl and wl.requests[0].prompt_token_ids == [1, 2, 3, 4]  # the original is kept
    with pytest.raises(ValueError, match=r"^--output-len must be >= 1, got 0"):
        wl.with_lengths(output_len=0)
    with pytest.raises(ValueError, match=r"^--prompt-len must be >= 1, got -2"):
        wl.with_lengths(prompt_len=-2)
