"""Bad input gets a 4xx naming the field, before any work is done, and the fleet carries on (issue 13's "Bad
input" list, one case each). A real fleet (tests/fuzz/conftest.py); raw HTTP where the body itself is the bad
input (invalid UTF-8, a lone surrogate, an oversized body), the `openai` client for the issue's reproduction."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fleet_harness import API_KEY
from fuzz_fleet import assert_alive, assert_openai_error, assert_serves, requests_placed, vocab_size

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HUGE = 10**30
NAN, INF = float("nan"), float("inf")  # json.dumps writes NaN and Infinity, which Python's json.loads reads
VOCAB = "<vocab>"  # replaced by the model's vocabulary size


def chat_content(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


# (endpoint, fields over a good body, the field the message must name); VOCAB in a value: the vocabulary size
CASES = {
    "top_k 2**63": (COMPLETIONS, {"top_k": 2**63}, "top_k"),
    "top_k -2": (COMPLETIONS, {"top_k": -2}, "top_k"),
    "top_k vocab+1": (COMPLETIONS, {"top_k": (VOCAB, 1)}, "top_k"),
    "n huge": (COMPLETIONS, {"n": HUGE}, "n"),
    "chat n huge": (CHAT, {"n": 10**6}, "n"),
    "best_of huge": (COMPLETIONS, {"best_of": HUGE}, "best_of"),
    "logprobs 21": (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    "logprobs -1": (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    "top_logprobs 21": (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs -1": (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "max_tokens 0": (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    "max_tokens huge": (COMPLETIONS, {"max_tokens": HUGE}, "max_tokens"),
    "max_tokens 2**63 chat": (CHAT, {"max_tokens": 2**63}, "max_tokens"),
    "max_completion_tokens 0": (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    "min_tokens > max_tokens": (COMPLETIONS, {"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    "min_tokens huge": (COMPLETIONS, {"min_tokens": HUGE}, "min_tokens"),
    "priority huge": (COMPLETIONS, {"priority": HUGE}, "priority"),
    "priority -huge": (CHAT, {"priority": -HUGE}, "priority"),
    "seed 2**64": (COMPLETIONS, {"seed": 2**64}, "seed"),
    "seed -2**63-1": (COMPLETIONS, {"seed": -(2**63) - 1}, "seed"),
    "presence_penalty 2.5": (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty -2.5": (CHAT, {"frequency_penalty": -2.5}, "frequency_penalty"),
    "repetition_penalty 0": (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty"),
    "repetition_penalty huge": (COMPLETIONS, {"repetition_penalty": 1e300}, "repetition_penalty"),
    "stop_token_ids vocab": (COMPLETIONS, {"stop_token_ids": [(VOCAB, 0)]}, "stop_token_ids"),
    "stop_token_ids -1": (CHAT, {"stop_token_ids": [-1]}, "stop_token_ids"),
    "stop_token_ids 2**63": (COMPLETIONS, {"stop_token_ids": [2**63]}, "stop_token_ids"),
    "logit_bias key vocab": (COMPLETIONS, {"logit_bias": {(VOCAB, 0): 1}}, "logit_bias"),
    "logit_bias key -1": (CHAT, {"logit_bias": {"-1": 1}}, "logit_bias"),
    "logit_bias key not a number": (COMPLETIONS, {"logit_bias": {"hello": 1}}, "logit_bias"),
    "logit_bias value 101": (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias"),
    "logit_bias value -101": (CHAT, {"logit_bias": {"5": -101}}, "logit_bias"),
    "too many stop strings": (COMPLETIONS, {"stop": [f"s{i}" for i in range(1000)]}, "stop"),
    "too long stop string": (CHAT, {"stop": ["x" * 100_000]}, "stop"),
    "temperature NaN": (COMPLETIONS, {"temperature": NAN}, "temperature"),
    "top_p NaN": (CHAT, {"top_p": NAN}, "top_p"),
    "min_p NaN": (COMPLETIONS, {"min_p": NAN}, "min_p"),
    "presence_penalty NaN": (COMPLETIONS, {"presence_penalty": NAN}, "presence_penalty"),
    "frequency_penalty Infinity": (CHAT, {"frequency_penalty": INF}, "frequency_penalty"),
    "repetition_penalty NaN": (COMPLETIONS, {"repetition_penalty": NAN}, "repetition_penalty"),
    "logit_bias value NaN": (COMPLETIONS, {"logit_bias": {"5": NAN}}, "logit_bias"),
    "logit_bias value -Infinity": (CHAT, {"logit_bias": {"5": -INF}}, "logit_bias"),
    "content part text not a string": (CHAT, chat_content([{"type": "text", "text": 5}]), "messages"),
    "content part without text": (CHAT, chat_content([{"type": "text"}]), "messages"),
    "content part type not a string": (CHAT, chat_content([{"type": 5, "text": "hi"}]), "messages"),
    "content part not an object": (CHAT, chat_content(["hi"]), "messages"),
}


@pytest.fixture(scope="module")
def vocab(fuzz_fleet) -> int:
    return vocab_size(fuzz_fleet)


def good_body(fleet, endpoint: str) -> dict:
    body = {"model": fleet.model, "max_tokens": 4}
    return body | ({"prompt": "hi"} if endpoint == COMPLETIONS else chat_content("hi"))


def with_vocab(value, vocab: int):
    """(VOCAB, k) -> vocab + k, anywhere in a value (dict keys become strings, as JSON has them)."""
    if isinstance(value, tuple) and value[:1] == (VOCAB,):
        return vocab + value[1]
    if isinstance(value, list):
        return [with_vocab(v, vocab) for v in value]
    if isinstance(value, dict):
        return {str(with_vocab(k, vocab)): with_vocab(v, vocab) for k, v in value.items()}
    return value


def post(fleet, endpoint: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(fleet.url() + endpoint, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_field_gets_400_naming_it(fleet, vocab, name):
    endpoint, fields, field = CASES[name]
    body = good_body(fleet, endpoint) | with_vocab(fields, vocab)
    placed = requests_placed(fleet)
    r = post(fleet, endpoint, json.dumps(body).encode())
    err = assert_openai_error(r.status_code, r.content)
    assert r.status_code == 400, f"{name}: HTTP {r.status_code} {err}"
    assert field in err["message"], f"{name}: the message does not name {field!r}: {err['message']!r}"
    assert requests_placed(fleet) == placed, f"{name}: the request was enqueued before it was refused"
    assert_alive(fleet)


@pytest.mark.parametrize("model", ["~no-such-user-here/model", "m" * 5000], ids=["home of no user", "too long"])
@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_model_name_that_is_no_path_here_gets_404(fleet, endpoint, model):
    """Found by the fuzz tier (a 500): a `model` of "~name" made pathlib raise while the gateway looked for a
    worker serving it."""
    r = post(fleet, endpoint, json.dumps(good_body(fleet, endpoint) | {"model": model}).encode())
    err = assert_openai_error(r.status_code, r.content)
    assert r.status_code == 404 and err["param"] == "model", (r.status_code, err)
    assert_alive(fleet)


@pytest.mark.parametrize("endpoint,raw,field", [
    (COMPLETIONS, '"prompt": "hi \\ud800 there"', "prompt"),
    (CHAT, '"messages": [{"role": "user", "content": "\\udfff"}]', "messages"),
    (CHAT, '"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud83d"}]}]', "messages"),
], ids=["completion prompt", "chat content", "chat content part"])
def test_lone_surrogate_gets_400(fleet, endpoint, raw, field):
    body = f'{{"model": {json.dumps(fleet.model)}, "max_tokens": 4, {raw}}}'.encode()
    r = post(fleet, endpoint, body)
    err = assert_openai_error(r.status_code, r.content)
    assert r.status_code == 400 and field in err["message"], (r.status_code, err)
    assert_alive(fleet)


def test_invalid_utf8_body_gets_400(fleet):
    body = b'{"model": "' + fleet.model.encode() + b'", "max_tokens": 4, "prompt": "caf\xe9 \xff\xfe"}'
    r = post(fleet, COMPLETIONS, body)
    err = assert_openai_error(r.status_code, r.content)
    assert r.status_code == 400 and "utf-8" in err["message"].lower(), (r.status_code, err)
    assert_alive(fleet)


@pytest.mark.parametrize("raw,headers", [
    (b"null", {}), (b"[]", {}), (b'"hi"', {}), (b"{", {}), (b"", {}),
    (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}),
    (b'{"model": "m", "prompt": "hi", "n": ' + b"9" * 5000 + b"}", {}),
    (b"\x1f\x8b not really gzip", {"Content-Encoding": "gzip"}),
], ids=["null", "a list", "a string", "cut short", "empty", "nested 100000 deep", "a 5000-digit integer",
        "gzip garbage"])
def test_malformed_body_gets_400(fleet, raw, headers):
    r = post(fleet, COMPLETIONS, raw, headers)
    err = assert_openai_error(r.status_code, r.content)
    assert r.status_code == 400, (r.status_code, err)
    assert_alive(fleet)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_gets_413_before_the_key_is_checked(fleet, chunked):
    body = b'{"model": "m", "prompt": "' + b"a" * (32 << 20) + b'"}'
    content = iter([body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)]) if chunked else body
    r = httpx.post(fleet.url() + COMPLETIONS, content=content, timeout=60,  # no Authorization header
                   headers={"Content-Type": "application/json"})
    err = assert_openai_error(r.status_code, r.content)
    assert r.status_code == 413, (r.status_code, err)
    assert_alive(fleet)


def test_top_k_0_and_minus_1_both_mean_off(fleet):
    """vLLM's meaning (0 is also the field's default), kept rather than the issue's "-1 or 1..vocab"."""
    texts = set()
    for top_k in (0, -1):
        r = post(fleet, COMPLETIONS, json.dumps(good_body(fleet, COMPLETIONS) | {"top_k": top_k, "temperature": 0,
                                                                                 "ignore_eos": True}).encode())
        assert r.status_code == 200, r.text
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1


def test_the_issues_reproduction_through_the_openai_client(fleet):
    """`{"prompt": "hi", "max_tokens": 4, "top_k": 9223372036854775808}` used to kill the worker."""
    client = fleet.client(timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=fleet.model, prompt="hi", max_tokens=4, extra_body={"top_k": 2**63})
    assert e.value.status_code == 400 and "top_k" in e.value.message
    assert_alive(fleet)
    assert_serves(fleet)


def test_the_fleet_serves_after_all_of_them(fleet):
    placed = requests_placed(fleet)
    assert_serves(fleet)  # a completion and a chat
    assert requests_placed(fleet) == placed + 2  # what the 400s above were checked against counts
    assert_alive(fleet)
