"""Structured outputs in the engine (gpu_worker.engine.structured, xgrammar) on a tiny random-weight model:
whatever the model would say, the answer follows the spec, through batching, preemption, n > 1 and a resumed
request; the sequence ends when its grammar is complete (ignore_eos too); a spec that does not compile, or
resumed tokens the grammar refuses, are the request's InvalidRequest."""

from __future__ import annotations

import json
import re

import pytest

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.llm_engine import InvalidRequest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"[A-Z]{2}-\d{3}"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # a cache too small for the whole batch at once: requests are preempted and recomputed
    return LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_model_len=128)


def test_every_kind_holds_under_batching_preemption_and_n(llm):
    prompts = [{"prompt_token_ids": list(range(200 + 10 * i, 230 + 10 * i))} for i in range(6)]
    kinds = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": ["yes", "no", "ask again later"]}, {"json_object": True},
             {"grammar": 'root ::= "(" [0-9]+ ")"'}, {"json": SCHEMA}]
    params = [SamplingParams(n=2 if i % 2 else 1, temperature=1.0, seed=i, max_tokens=60, structured_outputs=k)
              for i, k in enumerate(kinds)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for kind, out in zip(kinds, outs, strict=True):
        for c in out.outputs:
            if "json" in kind:
                got = json.loads(c.text)
                assert set(got) == {"ok", "n", "tag"} and got["n"] in (1, 2, 3) and re.fullmatch("[a-z]{1,4}", got["tag"])
            elif "regex" in kind:
                assert re.fullmatch(REGEX, c.text)
            elif "choice" in kind:
                assert c.text in ("yes", "no", "ask again later")
            elif "json_object" in kind:
                assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict)
            else:
                assert re.fullmatch(r"\(\d+\)", c.text) or (c.finish_reason == "length" and c.text.startswith("("))
            if "json_object" not in kind and "grammar" not in kind:
                assert c.finish_reason == "stop"


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 20}, {"min_tokens": 20, "ignore_eos": True}])
def test_the_grammar_ends_the_sequence_even_with_ignore_eos_or_min_tokens(llm, extra):
    """A complete grammar allows only its stop token: neither ignore_eos nor min_tokens (which bans the stop
    ids while the output is short) holds the sequence open (the fuzz tier found the 500 of that clash)."""
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=50, **extra,
                       structured_outputs={"choice": ["done"]}), use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].text == "done" and out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) < 20


def test_a_resumed_request_continues_its_grammar(llm):
    """A takeover resumes with the tokens already sent: the grammar replays them and the rest still fits."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": REGEX})
    whole = llm.generate({"prompt_token_ids": [9, 10, 11]}, params, use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    engine.add_request("resumed", [9, 10, 11], params, resume_output_token_ids=[whole.token_ids[:2]])
    new: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            new += out.outputs[0].token_ids
    assert re.fullmatch(REGEX, tok.decode(whole.token_ids[:2] + new, skip_special_tokens=True))
    bad = tok.encode("zz", add_special_tokens=False)
    with pytest.raises(InvalidRequest, match="does not fit the grammar"):
        engine.add_request("wrong", [9, 10, 11], params, resume_output_token_ids=[bad])


@pytest.mark.parametrize(("spec", "words"), [({"regex": "a(b"}, "structured_outputs.regex: does not compile"),
                                             ({"grammar": "root ::= nothing"}, "not defined"),
                                             ({"json": '{"type": "no-such-type"}'}, "structured_outputs.json")])
def test_a_spec_that_does_not_compile_is_the_requests_error(llm, spec, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_grammars_compile_once_for_two_threads(llm):
    """The worker's intake thread compiles ahead of its main thread: racing compiles of one spec all succeed and
    leave one cache entry, which every later compile returns."""
    from concurrent.futures import ThreadPoolExecutor

    grammars, spec = llm.engine.grammars, {"regex": r"[a-f]{3}\d"}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: grammars.compile(spec), range(8)))
    assert all(g is not None for g in got)
    assert [k for k in grammars._cache if k == ("regex", spec["regex"])] == [("regex", spec["regex"])]
    assert grammars.compile(spec) is grammars.compile(spec) is grammars._cache[("regex", spec["regex"])]


class _Stuck:
    """A grammar matcher that allows nothing next (a dead end), complete or not."""

    def __init__(self, completed: bool):
        self.completed = completed

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = 0

    def is_completed(self):
        return self.completed

    def is_terminated(self):
        return False


@pytest.mark.parametrize("completed", [True, False])
def test_a_grammar_that_allows_nothing_ends_or_fails_its_request_alone(llm, completed):
    """No token allowed: sampling would pick one the grammar refuses (a 500 before). A complete grammar with no
    stop token to end on ends the request with "stop"; a dead end fails it as its own input's fault (a 400,
    error_kind invalid_request). The other request of the step carries on."""
    engine = llm.engine
    engine.add_request("stuck", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "a+"}))
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prefill: both take a first token
    group = engine._groups["stuck"]
    group.seqs[0].constraint.matcher = _Stuck(completed)
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    last = outs["stuck"][-1]
    if completed:
        assert last.error is None and last.outputs[0].finish_reason == "stop"
    else:
        assert last.error_kind == "invalid_request" and "dead end" in last.error
        assert last.outputs[0].finish_reason == "error"
    assert outs["free"][-1].error is None and outs["free"][-1].outputs[0].finish_reason == "length"
