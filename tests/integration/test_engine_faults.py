"""A poison request fails alone, in the engine (tiny Llama, no Redis): a forward that fails with it in the
batch (bisection), a sampler that cannot use its parameters (the issue's top_k = 2**63, past validation),
a detokenizer that raises. It ends with finish_reason "error" and the reason, its blocks are freed, and
every other request's greedy tokens equal a run without it. When every request fails, each alone too,
the engine is broken: EngineFault. What this model cannot run is rejected at add_request."""

from __future__ import annotations

import math

import pytest

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.isolation import EngineFault
from gpu_worker.engine.llm_engine import InvalidRequest
from gpu_worker.engine.outputs import OutputAccumulator

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

GOOD = {f"good-{i}": [300 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=160, max_num_batched_tokens=64,
               max_model_len=96).engine


@pytest.fixture(scope="module")
def clean(engine):
    """The good requests' tokens with nothing else running."""
    for rid, prompt in GOOD.items():
        engine.add_request(rid, prompt, GREEDY)
    return {rid: out.outputs[0].token_ids for rid, out in run_all(engine).items()}


def run_all(engine, poison_after_steps: int = 0, add_poison=None):
    accumulators: dict[str, OutputAccumulator] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if add_poison is not None and steps == poison_after_steps:
            add_poison()
        for delta in engine.step():
            accumulators.setdefault(delta.request_id, OutputAccumulator()).add(delta)
        steps += 1
    return {rid: acc.result() for rid, acc in accumulators.items()}


def run_with(engine, poison_id: str, poison_params: SamplingParams, after_add=None):
    for rid, prompt in GOOD.items():
        engine.add_request(rid, prompt, GREEDY)

    def add_poison():
        engine.add_request(poison_id, [500, 501, 502, 503, 504, 505], poison_params)
        if after_add is not None:
            after_add()

    outs = run_all(engine, poison_after_steps=2, add_poison=add_poison)  # joins a running batch
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks, "every block is back, the poison's too"
    return outs


def assert_good(outs, clean):
    for rid, want in clean.items():
        assert outs[rid].error is None and outs[rid].outputs[0].finish_reason == "length"
        assert outs[rid].outputs[0].token_ids == want, rid


def test_a_forward_that_fails_with_one_request_in_the_batch_fails_that_request_only(engine, clean, monkeypatch):
    real, batches = engine.runner.execute, []

    def execute(sched):
        batches.append([s.request_id for s in sched.seqs])
        if any(s.request_id == "poison-forward" for s in sched.seqs):
            raise RuntimeError("injected forward fault")
        return real(sched)

    monkeypatch.setattr(engine.runner, "execute", execute)
    outs = run_with(engine, "poison-forward", GREEDY)
    assert_good(outs, clean)
    bad = outs["poison-forward"]
    assert bad.finished and [o.finish_reason for o in bad.outputs] == ["error"]
    assert "injected forward fault" in bad.error
    failing = next(i for i, b in enumerate(batches) if "poison-forward" in b)
    full = batches[failing]
    assert full[-1] == "poison-forward", "the newest admission is last in the batch"
    retries = batches[failing + 1:]
    assert retries[0] == full[: len(full) // 2], "the first retry leaves the newest admissions out"
    assert ["poison-forward"] in retries, "the culprit failed alone before it was blamed"
    assert sum("poison-forward" in b for b in batches) <= 1 + len(full).bit_length(), "bisection, not one by one"


def test_a_sampler_failure_fails_that_row_only_the_issue_reproducer(engine, clean):
    """top_k = 2**63 past every check: torch.tensor([top_k]) overflows in the batched sampler."""
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=8)

    def corrupt():
        engine._groups["poison-topk"].seqs[0].request.sampling_params.top_k = 2**63

    outs = run_with(engine, "poison-topk", sampled, after_add=corrupt)
    assert_good(outs, clean)
    bad = outs["poison-topk"]
    assert bad.outputs[0].finish_reason == "error" and "sampling failed" in bad.error
    assert "Overflow" in bad.error or "overflow" in bad.error


def test_a_detokenizer_failure_fails_that_request_only(engine, clean):
    def break_detok():
        seq = engine._groups["poison-detok"].seqs[0]

        def add_tokens(ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

        seq.detok.add_tokens = add_tokens

    outs = run_with(engine, "poison-detok", GREEDY, after_add=break_detok)
    assert_good(outs, clean)
    assert "detokenizing failed: UnicodeDecodeError" in outs["poison-detok"].error


def test_a_forward_that_fails_for_everyone_is_the_engines_fault(engine, monkeypatch):
    def broken(sched):
        raise RuntimeError("device lost")

    for rid, prompt in list(GOOD.items())[:3]:
        engine.add_request(rid, prompt, GREEDY)
    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(EngineFault, match="device lost"):
        engine.step()
    for rid in list(GOOD)[:3]:
        engine.abort_request(rid)


def test_a_temperature_that_would_make_nan_probabilities_samples_normally(engine):
    """temperature 1e-40 would divide the logits into inf and the probabilities into NaN."""
    engine.add_request("tiny-t", GOOD["good-0"], SamplingParams(temperature=1e-40, seed=1, max_tokens=12,
                                                                ignore_eos=True, logprobs=2))
    out = run_all(engine)["tiny-t"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert all(0 <= t < engine.runner.vocab_size for t in out.token_ids)
    assert all(math.isfinite(v) for lp in out.logprobs for v in lp.values())


@pytest.mark.parametrize(("params", "message"), [
    (dict(top_k=10**9), r"top_k must be -1 \(off\) or in \[1, \d+\]"),
    (dict(stop_token_ids=[10**9]), r"stop_token_ids: 1000000000 is outside the vocabulary"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids: -1 is outside the vocabulary"),
])
def test_what_this_model_cannot_run_is_rejected_at_add(engine, params, message):
    sp = SamplingParams(temperature=0.5, max_tokens=4)
    for k, v in params.items():  # past SamplingParams' own checks, as a producer that skipped the gateway
        setattr(sp, k, v)
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request("bad", [1, 2, 3], sp)
    assert not engine.has_unfinished_requests()
