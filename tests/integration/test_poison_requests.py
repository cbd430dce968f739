"""A poison request fails alone (issue 13), in a real worker process (tests/fault_worker.py: the real worker
with faults injected by seed) on a tiny model, fed straight through its Redis stream: no gateway checks.
While 8 good greedy requests run, each poison input gets its error chunk and a dead letter with the reason;
the good ones finish with the tokens of a clean run; nobody is delivered twice; the worker never exits.
Then the same faults through the gateway (an SSE error event, a 500), non-finite logprobs through Redis,
and a reader thread that dies: the worker stops, exit status 1, its status gone."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fault_worker import DETOK_SEED, FORWARD_SEED, KILL_CANCEL_THREAD, SAMPLER_SEED
from fleet_harness import Fleet

from shared import keys, streams
from shared.messages import DeadLetter, GenerationRequest, OutputChunk, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

WID = "w-poison"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("poison"), env={"KVFLEET_HEARTBEAT_S": "0.5"}) as f:
        f.start_worker(WID, "--num-kv-blocks", "256", "--max-num-seqs", "32", script="fault_worker.py")
        f.start_gateway()
        f.wait_ready(workers=1)
        yield f


@pytest.fixture(scope="module")
def r(fleet):
    client = streams.connect(fleet.redis.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def vocab(fleet) -> int:
    return json.loads((Path(fleet.model) / "config.json").read_text())["vocab_size"]


def good_request(rid: str, i: int) -> GenerationRequest:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return GenerationRequest(request_id=rid, prompt_token_ids=[1] + [400 + 11 * i + j for j in range(6 + i)],
                             sampling_params=params.to_dict())


def poison_request(rid: str, **params) -> GenerationRequest:
    sp = SamplingParams(temperature=params.pop("temperature", 0.0), max_tokens=8).to_dict() | params
    return GenerationRequest(request_id=rid, prompt_token_ids=[1, 415, 2936, 9060, 285], sampling_params=sp)


def output(r, rid: str) -> list[OutputChunk]:
    return list(streams.iter_output(r, rid, timeout_s=120))


def tokens(chunks: list[OutputChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def dead_letters(r) -> list[DeadLetter]:
    return [DeadLetter.model_validate_json(f[keys.FIELD]) for _, f in r.xrange(keys.DEAD)]


def assert_worker_alive(fleet: Fleet, r, pid: int) -> None:
    assert fleet.workers[WID].poll() is None, fleet.tail()
    assert WorkerStatus.model_validate_json(r.get(keys.status(WID))).pid == pid


def test_each_poison_fails_alone_while_good_requests_finish_as_in_a_clean_run(fleet, r, vocab):
    pid = WorkerStatus.model_validate_json(r.get(keys.status(WID))).pid
    stream = keys.req_stream(WID)
    for i in range(8):
        streams.enqueue(r, good_request(f"clean-{i}", i), WID)
    clean = {i: tokens(output(r, f"clean-{i}")) for i in range(8)}

    for i in range(8):
        streams.enqueue(r, good_request(f"good-{i}", i), WID)
    fleet.wait_for(lambda: all(r.xlen(keys.out_stream(f"good-{i}")) for i in range(8)), timeout_s=60,
                   what="the good requests to be running")
    poison = {  # request id -> (what its error chunk says, its kind)
        "p-top-k-2**63": (poison_request("p-top-k-2**63", top_k=2**63, temperature=0.5), "top_k", "invalid_request"),
        "p-top-k-vocab": (poison_request("p-top-k-vocab", top_k=vocab + 1, temperature=0.5), "top_k", "invalid_request"),
        "p-stop-id": (poison_request("p-stop-id", stop_token_ids=[vocab + 5]), "stop_token_ids", "invalid_request"),
        "p-logit-bias": (poison_request("p-logit-bias", logit_bias={str(vocab + 5): 5}), "logit_bias",
                         "invalid_request"),
        "p-version": (poison_request("p-version").model_copy(update={"v": 99}), "schema version v=99",
                      "invalid_request"),
        "p-forward": (poison_request("p-forward", seed=FORWARD_SEED), "injected forward fault", "internal"),
        "p-sampler": (poison_request("p-sampler", seed=SAMPLER_SEED, temperature=0.7), "injected sampler fault",
                      "internal"),
        "p-detok": (poison_request("p-detok", seed=DETOK_SEED), "injected detokenizer fault", "internal"),
    }
    for request, _, _ in poison.values():
        streams.enqueue(r, request, WID)
    r.xadd(stream, {keys.FIELD: "{not json"})
    r.xadd(stream, {"not-the-field": "x"})
    streams.enqueue(r, poison_request("p-nan", temperature=1e-40, seed=1, logprobs=3), WID)  # NaN-prone, valid

    for rid, (_, says, kind) in poison.items():
        *_, last = output(r, rid)
        assert last.final and last.error is not None, (rid, last)
        assert (last.error.kind, last.finish_reason) == (kind, "error"), (rid, last)
        assert says in last.error.message, (rid, last.error.message)
    nan = output(r, "p-nan")
    assert nan[-1].finish_reason == "length" and nan[-1].error is None and len(tokens(nan)) == 8
    for i in range(8):
        chunks = output(r, f"good-{i}")
        assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
        assert tokens(chunks) == clean[i], f"good-{i} differs from the clean run"
        assert [c.seq for c in chunks] == list(range(len(chunks)))

    letters = fleet.wait_for(lambda: len(dead_letters(r)) >= len(poison) + 2 and dead_letters(r), timeout_s=10,
                             what="the dead letters")
    by_id = {d.request.request_id: d for d in letters if d.request is not None}
    assert set(by_id) == set(poison), "each poison request, and nothing else, is dead-lettered"
    for rid, (_, says, _) in poison.items():
        assert says in by_id[rid].reason and by_id[rid].deliveries == 1 and by_id[rid].worker_id == WID
    malformed = sorted(d.reason for d in letters if d.request is None)
    assert len(malformed) == 2 and all(m.startswith("malformed request entry") for m in malformed)
    assert {json.dumps({keys.FIELD: "{not json"}), json.dumps({"not-the-field": "x"})} == \
        {d.raw for d in letters if d.request is None}
    assert r.xpending(stream, keys.GROUP)["pending"] == 0 and r.xlen(stream) == 0, "everything acked, once"
    assert_worker_alive(fleet, r, pid)


def test_the_gateway_relays_a_failed_request_as_an_openai_error(fleet, r):
    pid = WorkerStatus.model_validate_json(r.get(keys.status(WID))).pid
    client = fleet.client(timeout=60)
    stream = client.completions.create(model=fleet.model, prompt="hello", max_tokens=8, temperature=0.7,
                                       seed=SAMPLER_SEED, stream=True)
    with pytest.raises(openai.APIError, match="injected sampler fault"):
        for _ in stream:
            pass
    with pytest.raises(openai.InternalServerError, match="injected forward fault"):
        client.chat.completions.create(model=fleet.model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       seed=FORWARD_SEED)
    ok = client.completions.create(model=fleet.model, prompt="hello", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    assert_worker_alive(fleet, r, pid)


def test_non_finite_logprobs_make_a_readable_chunk_through_redis(r):
    inf = OutputChunk(request_id="lp-inf", seq=0, token_ids=[5], final=True,
                      logprobs=[{5: float("-inf"), 6: float("nan"), 7: -1.5}])
    streams.publish(r, "w-test", output_ttl_s=60, chunks=[inf])
    [back] = list(streams.iter_output(r, "lp-inf", timeout_s=10))
    assert back.logprobs == [{5: -9999.0, 6: -9999.0, 7: -1.5}]


def test_a_reader_thread_that_dies_stops_the_worker_and_removes_its_status(fleet, r):
    """Last: the worker exits (its supervisor, `kvfleet up`, would start it again)."""
    streams.cancel(r, KILL_CANCEL_THREAD)
    proc = fleet.workers[WID]
    assert proc.wait(timeout=60) == 1, fleet.tail()
    assert r.get(keys.status(WID)) is None
    log = fleet.logs[WID].read_text()
    assert "kvfleet-cancels died" in log
