"""The engine's async output processing (LLMEngine(async_output=True)) on a tiny Llama: each step's forward runs on
a thread of its own while the step before it is detokenized and its outputs built, and the outputs are those of
the engine without it, whatever ends a request while the next forward runs (a stop string, a grammar's end, an
abort, the same id placed again)."""

import os
import threading

import pytest

from gpu_worker import LLMEngine, SamplingParams
from gpu_worker.engine.isolation import EngineFault
from gpu_worker.engine.outputs import OutputAccumulator

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [list(range(300 + 7 * i, 321 + 7 * i + 3 * i)) for i in range(6)]  # 21 to 36 tokens


def engine(model_dir, *, async_output, num_kv_blocks=96):
    return LLMEngine.from_model(str(model_dir), block_size=4, num_kv_blocks=num_kv_blocks,
                                max_num_batched_tokens=64, max_model_len=128, async_output=async_output)


def run_all(eng, requests, *, before_step=None):
    """Add `requests` ({id: (prompt, params)}), step until idle; {id: (token ids, text, finish, stop reason,
    logprobs, prompt logprobs)}. before_step(eng, step number) runs before each step."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    acc, n = {}, 0
    while eng.has_unfinished_requests():
        if before_step is not None:
            before_step(eng, n)
        for delta in eng.step():
            acc.setdefault(delta.request_id, OutputAccumulator()).add(delta)
        n += 1
    results = {}
    for rid, a in acc.items():
        out = a.result()
        results[rid] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.prompt_logprobs)
                        for c in out.outputs] + [out.error]
    return results


def greedy_reference(model_dir):
    """The greedy outputs of PROMPTS[1] and PROMPTS[2]: a stop string in the middle of the first, a stop id in the
    second."""
    eng = engine(model_dir, async_output=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        out = run_all(eng, {"1": (PROMPTS[1], params), "2": (PROMPTS[2], params)})
        return out["1"][0][1], out["2"][0][0]
    finally:
        eng.close()


def mixed_requests(stop, stop_id):
    return {
        "greedy": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)),
        "stop-string": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])),
        "stop-id": (PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                               stop_token_ids=[stop_id])),
        "seeded-n2": (PROMPTS[3], SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=2, max_tokens=12,
                                                 ignore_eos=True)),
        "min-tokens": (PROMPTS[4], SamplingParams(temperature=0, max_tokens=9, min_tokens=5)),
        "prompt-logprobs": (PROMPTS[5], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)),
        "grammar": (PROMPTS[0][:5], SamplingParams(temperature=0, max_tokens=30,
                                                   structured_outputs={"choice": ["alpha", "beta", "gamma delta"]})),
        "one-token": (PROMPTS[2][:9], SamplingParams(temperature=0, max_tokens=1)),
    }


@pytest.mark.parametrize("num_kv_blocks", [96, 24], ids=["roomy", "preempting"])
def test_the_outputs_are_those_of_the_engine_without_it(tiny_llama_dir, num_kv_blocks):
    text, tokens = greedy_reference(tiny_llama_dir)
    stop, stop_id = text[len(text) // 2:len(text) // 2 + 3], tokens[6]
    results = {}
    for async_output in (False, True):
        eng = engine(tiny_llama_dir, async_output=async_output, num_kv_blocks=num_kv_blocks)
        try:
            results[async_output] = run_all(eng, mixed_requests(stop, stop_id))
            stats = eng.stats()
            assert stats.num_running == stats.num_waiting == 0
            if num_kv_blocks == 24:
                assert eng.stats().num_preemptions > 0  # the small cache did preempt
        finally:
            eng.close()
    sync, overlapped = results[False], results[True]
    assert sync["stop-string"][0][2:4] == ("stop", stop)  # the stop string did end it early
    assert sync["grammar"][0][1] in ("alpha", "beta", "gamma delta") and sync["grammar"][0][2] == "stop"
    assert sync["stop-id"][0][2:4] == ("stop", stop_id)
    assert overlapped == sync


def test_the_forward_runs_while_the_step_before_it_is_processed(tiny_llama_dir):
    """The runner's forward waits until step() has returned: step() must not wait for the forward it launched."""
    eng = engine(tiny_llama_dir, async_output=True)
    returned, threads = threading.Semaphore(0), []  # one release per step() returned: one forward goes on
    execute = eng.runner.execute

    def gated(sched):
        threads.append(threading.current_thread().name)
        if not returned.acquire(timeout=30):
            raise AssertionError("step() waited for the forward it launched")
        return execute(sched)

    eng.runner.execute = gated
    try:
        eng.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        seen = []
        while eng.has_unfinished_requests():
            seen += eng.step()
            returned.release()
        assert all(name.startswith("kvfleet-step") for name in threads) and len(threads) == 4
        assert [len(o.outputs[0].token_ids) for o in seen] == [1, 1, 1, 1] and seen[-1].finished
    finally:
        for _ in range(8):
            returned.release()
        eng.close()


def test_an_abort_and_the_same_id_placed_again_while_a_forward_runs(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eng = engine(tiny_llama_dir, async_output=False)
    try:
        reference = run_all(eng, {"a": (PROMPTS[0], params), "b": (PROMPTS[1], params)})
    finally:
        eng.close()

    def abort_and_place_again(e, step):
        if step == 3:  # "a" has a forward in flight: aborted, then placed again under the same id
            e.abort_request("a")
            e.add_request("a", PROMPTS[0], params)

    eng = engine(tiny_llama_dir, async_output=True)
    try:
        got = run_all(eng, {"a": (PROMPTS[0], params), "b": (PROMPTS[1], params)}, before_step=abort_and_place_again)
        stats = eng.stats()
        assert stats.free_blocks == stats.total_blocks  # nothing leaked
    finally:
        eng.close()
    assert got["b"] == reference["b"]
    # the deltas of the first "a" before the abort fold into the same accumulator: the second run's are the tail
    tokens = got["a"][0][0]
    assert tokens[-10:] == reference["a"][0][0] and got["a"][0][2] == "length"


def test_a_broken_forward_in_flight_stops_the_next_step(tiny_llama_dir):
    eng = engine(tiny_llama_dir, async_output=True)

    def broken(sched):
        raise RuntimeError("device lost")

    try:
        eng.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
        eng.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
        eng.runner.execute = broken
        assert eng.step() == []  # launched; its failure is the next step's
        with pytest.raises(EngineFault, match="device lost"):
            eng.step()
    finally:
        eng.close()


def test_a_request_the_forward_fails_fails_alone(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = engine(tiny_llama_dir, async_output=True)
    execute = eng.runner.execute

    def fails_on_bad(sched):
        if any(s.request_id == "bad" for s in sched.seqs):
            raise ValueError("bad input")
        return execute(sched)

    eng.runner.execute = fails_on_bad
    try:
        got = run_all(eng, {"good": (PROMPTS[0], params), "bad": (PROMPTS[1], params)})
    finally:
        eng.close()
    assert got["bad"][0][2] == "error" and "bad input" in got["bad"][-1]
    assert len(got["good"][0][0]) == 6 and got["good"][-1] is None


def test_a_worker_with_it_serves_stop_strings_streams_and_cancels(tiny_llama_dir, tmp_path):
    """`kvfleet worker --async-output` through the gateway and the real openai client: a stop string ends the text
    where it begins (the token scheduled after it never reaches the client), a stream's chunks add up to the
    answer, n = 2 seeded samples repeat, a stream the client drops mid-answer is cancelled, and the worker ends
    with every block free."""
    from fleet_harness import STOP_PROMPT, Fleet, text_and_a_stop_string

    with Fleet(tiny_llama_dir, tmp_path) as fleet:
        fleet.start_worker("w0", "--num-kv-blocks", "64", "--max-num-seqs", "16", "--async-output")
        fleet.start_gateway()
        fleet.wait_ready(workers=1)
        client, model = fleet.client(timeout=120), os.path.basename(fleet.model)
        prompt = STOP_PROMPT
        text, stop = text_and_a_stop_string(client, model)
        cut = text.index(stop)
        out = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text[:cut], "stop")
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                             stream=True, extra_body={"ignore_eos": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:cut]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]

        def two(seed):
            r = client.completions.create(model=model, prompt="Words:", max_tokens=8, temperature=1.0, n=2, seed=seed,
                                          extra_body={"ignore_eos": True})
            return sorted(c.text for c in r.choices)

        assert two(99) == two(99)

        with fleet.http(timeout=60) as h, h.stream("POST", "/v1/completions", json={
                              "model": model, "prompt": prompt, "max_tokens": 400, "stream": True,
                              "ignore_eos": True}) as r:
            data = 0
            for line in r.iter_lines():
                data += line.startswith("data: {")
                if data == 3:
                    break  # three chunks of the answer, then the client goes
            assert data == 3

        def idle():
            s = fleet.worker_status("w0")
            return s["running"] == 0 and s["waiting"] == 0 and s["free_blocks"] == s["total_blocks"]

        fleet.wait_for(idle, timeout_s=60, what="the worker idle with every block free")
        after = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0]
        assert after.text and text.startswith(after.text) and after.finish_reason == "length"
        log = fleet.logs["w0"].read_text(errors="replace")
        assert "ERROR" not in log and "Traceback" not in log, log[-3000:]  # no step failed along the way


def test_tensor_parallel_ranks_run_the_forward_from_its_thread(tiny_llama_dir):
    """With tensor_parallel_size 2 the forward on the step thread drives the executor process: the same outputs."""
    import multiprocessing

    from gpu_worker import LLM

    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    texts = {}
    for async_output in (False, True):
        with LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=128, tensor_parallel_size=2,
                 async_output=async_output) as llm:
            texts[async_output] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert texts[True] == texts[False] and all(len(t) == 6 for t in texts[True])
    assert not multiprocessing.active_children()
