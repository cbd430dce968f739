"""The engine's outputs are deltas (vLLM's RequestOutputKind.DELTA): each holds only what its step produced,
and concatenated they are the offline API's complete output, with n > 1, stop strings and preemption."""

from collections import defaultdict

import pytest

from gpu_worker import LLM, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

A, B, C = list(range(300, 321)), list(range(400, 417)), list(range(500, 529))  # 21, 17, 29 tokens


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 24 blocks of 4 tokens hold less than the batch below needs (about 50 blocks), so requests are
    # preempted and recomputed. No prefix cache: a second run of the batch computes exactly as the first.
    return LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=24, max_num_batched_tokens=64, max_model_len=96,
               enable_prefix_caching=False)


def stream(engine, batch):
    """Run the batch through engine.step(): per request and sample, the deltas concatenated, checking that no
    delta holds more than its step produced."""
    tokens, texts, logprobs = defaultdict(list), defaultdict(str), defaultdict(list)
    last, deltas = {}, []
    for rid, (prompt, params) in enumerate(batch):
        engine.add_request(str(rid), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert [c.index for c in out.outputs] == list(range(batch[int(out.request_id)][1].n))
            for c in out.outputs:
                key = (int(out.request_id), c.index)
                assert len(c.token_ids) <= 1  # one step samples at most one token per sequence
                assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
                tokens[key] += c.token_ids
                texts[key] += c.text
                logprobs[key] += c.logprobs or []
                last[key] = c
                deltas.append(c)
    assert all(len(c.token_ids) <= 1 for c in deltas)  # no delta aliases a list the engine kept growing
    return tokens, texts, logprobs, last


def test_deltas_concatenate_to_the_offline_output(llm):
    tok = llm.get_tokenizer()
    ref = llm.generate({"prompt_token_ids": B}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    cut = ref.text.index(stop)
    maybe = tok.decode(ref.token_ids[:6])[-3:] + "\u2603"  # begins where the text of 6 tokens ends: held back
    batch = [
        (A, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True, logprobs=2)),
        (B, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[maybe, stop], logprobs=0)),
        (B, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                           include_stop_str_in_output=True)),
        (C, SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)),
    ]
    before = llm.engine.stats().num_preemptions
    complete = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    middle = llm.engine.stats().num_preemptions
    tokens, texts, logprobs, last = stream(llm.engine, batch)
    assert middle > before and llm.engine.stats().num_preemptions - middle == middle - before > 0

    for r, out in enumerate(complete):
        assert len(out.outputs) == batch[r][1].n
        for c in out.outputs:
            key = (r, c.index)
            assert tokens[key] == c.token_ids
            assert texts[key] == c.text
            assert logprobs[key] == (c.logprobs or [])
            assert (last[key].finish_reason, last[key].stop_reason) == (c.finish_reason, c.stop_reason)
            assert last[key].cumulative_logprob == c.cumulative_logprob
    for key in [(0, 0), (0, 1), (0, 2), (3, 0), (3, 1)]:  # no stop: every token once, although preempted
        assert len(tokens[key]) == 16 and texts[key] == tok.decode(tokens[key], skip_special_tokens=True)
        assert len(logprobs[key]) == 16
    assert (texts[(1, 0)], last[(1, 0)].stop_reason) == (ref.text[:cut], stop)
    assert texts[(2, 0)] == ref.text[: cut + len(stop)]
    assert tokens[(1, 0)] == tokens[(2, 0)] == ref.token_ids[: len(tokens[(1, 0)])]


def test_a_step_sends_only_what_it_produced(llm):
    """However long the output grows, each output holds the step's token, its logprobs and its text."""
    engine = llm.engine
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=70, ignore_eos=True, logprobs=3,
                            stop=["\u2603 never", " \u2603"])
    engine.add_request("long", A, params)
    per_step, text = defaultdict(list), defaultdict(str)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                per_step[c.index].append(len(c.token_ids))
                assert len(c.logprobs) == len(c.token_ids)
                text[c.index] += c.text
    for i in (0, 1):
        assert set(per_step[i]) <= {0, 1} and sum(per_step[i]) == 70
    complete = llm.generate({"prompt_token_ids": A}, params, use_tqdm=False)[0]
    assert [text[c.index] for c in complete.outputs] == [c.text for c in complete.outputs]


def test_prompt_logprobs_come_once_per_request_with_its_first_tokens(llm):
    """n = 3 samples share one prompt: its logprobs ride in the request's first output with tokens, once (a
    64-choice request would otherwise carry 64 copies), and a request resumed with tokens sent gets none."""
    engine = llm.engine
    engine.add_request("p", A, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=2))
    engine.add_request("r", B, SamplingParams(max_tokens=4, prompt_logprobs=1), resume_output_token_ids=[[5, 6]])
    carried: dict[str, list] = defaultdict(list)
    first_tokens: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            for c in out.outputs:
                if c.token_ids and out.request_id not in first_tokens:
                    first_tokens[out.request_id] = steps
                if c.prompt_logprobs is not None:
                    carried[out.request_id].append((steps, c.prompt_logprobs))
    (step, lps), = carried["p"]
    assert step == first_tokens["p"] and len(lps) == len(A) and lps[0] is None and all(lps[1:])
    assert "r" not in carried
