"""Simulated workers (`kvfleet worker --simulate PROFILE`) are real workers: the same engine (scheduler, KV cache
manager, sampler, detokenizer), the same chunks protocol through Redis and the gateway, the same takeover. Their
tokens are the cost model's, a function of (seed, request id, position): the text a client gets is those
tokens detokenized, max_tokens is honoured, and a request continued by another worker after a SIGKILL gets
the same tokens as an uninterrupted run, each once."""

from __future__ import annotations

import signal

import pytest
from fleet_harness import Fleet

from gpu_worker.engine.simulated import SimulatedEngine, simulated_engine
from gpu_worker.executor.cost_model import CostProfile
from shared import keys, streams
from shared.messages import GenerationRequest, OutputChunk
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

STATUS_TTL_S = 2.0
ENV = {"KVFLEET_STATUS_TTL_S": str(STATUS_TTL_S), "KVFLEET_HEARTBEAT_S": "0.5"}
# 20 ms a step: a 300-token request runs for about 6 s, long enough to be killed in the middle of it
PROFILE = CostProfile("test-sim", a_s=0.02, b_s_per_prefill_token=1e-5, c_s_per_decode_seq=1e-4,
                      d_s_per_context_token=1e-7, num_kv_blocks=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "test-sim.json"
    PROFILE.save(path)
    return path


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> SimulatedEngine:
    """An in-process simulated engine of the same model: what a worker's tokens and text must be."""
    return simulated_engine(CostProfile("free", 0.0, 0.0, 0.0, 0.0, num_kv_blocks=256), str(tiny_llama_dir))


def expected_tokens(model: SimulatedEngine, request_id: str, prompt_len: int, n: int) -> list[int]:
    return [model.runner.token(request_id, prompt_len + i) for i in range(n)]


def run_all(engine: SimulatedEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return tokens


def test_the_engine_gives_the_same_tokens_resumed_or_preempted(model, tiny_llama_dir):
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=11)
    want = expected_tokens(model, "r", len(prompt), 24)
    model.add_request("r", prompt, params)
    assert run_all(model) == {"r": want}
    model.add_request("r", prompt, params, resume_output_token_ids=[want[:9]])  # taken over after 9 tokens
    assert run_all(model) == {"r": want[9:]}
    # 12 blocks for 6 requests that need 4 each: they preempt one another and recompute
    tight = simulated_engine(CostProfile("tight", 0.0, 0.0, 0.0, 0.0, num_kv_blocks=12), str(tiny_llama_dir))
    for i in range(6):
        tight.add_request(f"q{i}", prompt[:20], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    got = run_all(tight)
    assert tight.stats().num_preemptions > 0
    assert got == {f"q{i}": expected_tokens(model, f"q{i}", 20, 40) for i in range(6)}


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, profile_path, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("fleet-sim"), env=ENV) as f:
        for wid in ("w0", "w1"):
            f.start_worker(wid, "--simulate", str(profile_path))
        f.start_gateway()
        f.wait_ready(workers=2)
        yield f


def test_simulated_workers_serve_through_the_gateway(fleet, model):
    statuses = fleet.fleet_status()["workers"]
    assert {w["simulated"] for w in statuses} == {"test-sim"}
    assert {w["total_blocks"] for w in statuses} == {PROFILE.num_kv_blocks}
    client = fleet.client(timeout=60)
    stream = client.completions.create(model=fleet.model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    text, finish, usage, rid = "", None, None, None
    for event in stream:
        rid = event.id
        if event.choices:
            text += event.choices[0].text
            finish = event.choices[0].finish_reason or finish
        if event.usage:
            usage = event.usage
    assert finish == "length" and usage.completion_tokens == 16
    want = expected_tokens(model, rid, usage.prompt_tokens, 16)
    assert text == model.tokenizer.decode(want)

    chat = client.chat.completions.create(model=fleet.model, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=7, temperature=1.3, seed=4)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 7
    want = expected_tokens(model, chat.id, chat.usage.prompt_tokens, 7)
    assert chat.choices[0].message.content == model.tokenizer.decode(want)


def put(r, worker: str, rid: str, prompt: list[int], max_tokens: int) -> None:
    streams.ensure_group(r, keys.req_stream(worker))
    request = GenerationRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True).to_dict())
    streams.enqueue(r, request, worker)


def tokens(chunks: list[OutputChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_simulated_worker_killed_mid_request_is_taken_over_with_the_same_tokens(fleet, model):
    r = streams.connect(fleet.redis.url)
    prompt, max_tokens = [7, 8, 9, 10, 11], 300
    put(r, "w1", "killed", prompt, max_tokens)
    fleet.wait_for(lambda: len(tokens(streams.read_all_chunks(r, "killed"))) >= 20, what="w1 to generate")
    fleet.signal_worker("w1", signal.SIGKILL)
    got = tokens(list(streams.iter_output(r, "killed", timeout_s=90)))
    assert got == expected_tokens(model, "killed", len(prompt), max_tokens)  # each token once, none changed
    raw = streams.read_all_chunks(r, "killed")
    assert [c.seq for c in raw] == list(range(len(raw)))  # written once: no sequence number twice
    assert raw[-1].final and raw[-1].error is None and raw[-1].finish_reason == "length"
    writers = [c.worker_id for c in raw]
    assert writers[0] == "w1" and writers[-1] == "w0", writers
