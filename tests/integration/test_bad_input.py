"""Bad input through the real `openai` client (and raw HTTP where the client cannot send it) against a real
gateway and worker on the tiny model: each gets a 400 or 413 in OpenAI's error shape naming the field and the
limit, before any work is done; no process exits, and the fleet serves a good request afterwards."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from fleet_harness import API_KEY, Fleet

pytestmark = pytest.mark.integration

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("bad-input"),
               env={"KVFLEET_MAX_BODY_BYTES": str(MAX_BODY)}) as f:
        f.start_worker("w0", "--num-kv-blocks", "64")
        f.start_gateway()
        f.wait_ready(workers=1)
        yield f


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir):
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tiny_llama_dir))


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_each_bad_field_gets_400_naming_it_and_the_fleet_keeps_serving(fleet, vocab):
    client, model = fleet.client(timeout=60), os.path.basename(fleet.model)
    chat = [{"role": "user", "content": "hi"}]
    completions = [
        ({"top_k": 2**63}, "top_k", "2147483647"),  # the value that once took the whole fleet down
        ({"top_k": vocab + 1}, "top_k", str(vocab)),
        ({"seed": 2**64}, "seed", "9223372036854775807"),
        ({"n": 65}, "n", "64"),
        ({"best_of": 3}, "best_of", "must equal n"),
        ({"suffix": "\n}"}, "suffix", "not supported"),
        ({"logprobs": 21}, "logprobs", "20"),
        ({"max_tokens": 2**40}, "max_tokens", "2147483647"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "<= max_tokens"),
        ({"priority": 2**31}, "priority", "2147483647"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "0"),
        ({"stop": ["s"] * 17}, "stop", "16"),
        ({"stop": ["s" * 257]}, "stop[0]", "256"),
        ({"stop_token_ids": [vocab]}, "stop_token_ids[0]", str(vocab)),
        ({"logit_bias": {str(vocab): 1}}, f"logit_bias.{vocab}", str(vocab)),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "100"),
    ]
    for fields, param, limit in completions:
        base = {"max_tokens": 4} | fields
        extra = {k: base.pop(k) for k in list(base) if k in ("top_k", "min_tokens", "priority", "stop_token_ids",
                                                                "repetition_penalty")}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hello", extra_body=extra, **base)
        err = _error(e.value)
        assert err["param"] == param and limit in err["message"] and err["type"] == "invalid_request_error", err
    for messages, param in [
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url",
                                                                      "image_url": {"url": "http://x/y.png"}}]}],
         "messages[0].content[1].type"),
        ([{"role": "user", "content": [{"type": "text", "text": ["not", "a", "string"]}]}],
         "messages[0].content[0].text"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        assert _error(e.value)["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=chat, max_tokens=4, logprobs=True, top_logprobs=21)
    assert _error(e.value)["param"] == "top_logprobs"

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=fleet.url(), headers=headers, timeout=60) as h:
        surrogate = h.post("/v1/chat/completions", content=b'{"model": "%s", "max_tokens": 4, "messages": '
                           b'[{"role": "user", "content": "a \\ud800 b"}]}' % model.encode())
        assert surrogate.status_code == 400, surrogate.text
        assert surrogate.json()["error"]["param"] == "messages[0].content"
        not_utf8 = h.post("/v1/completions", content=b'{"model": "%s", "prompt": "\xff\xfe"}' % model.encode())
        assert not_utf8.status_code == 400 and "UTF-8" in not_utf8.json()["error"]["message"], not_utf8.text
        huge = {"model": model, "prompt": "x" * (MAX_BODY + 1), "max_tokens": 1}
        too_large = h.post("/v1/completions", json=huge)
        assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
        assert str(MAX_BODY) in too_large.json()["error"]["message"]
        unkeyed = httpx.post(fleet.url() + "/v1/completions", json=huge)  # no key: the size is judged first
        assert unkeyed.status_code == 413

    assert all(p.poll() is None for p in [*fleet.workers.values(), *fleet.gateways.values()]), fleet.tail()
    assert fleet.worker_status("w0")["num_finished"] == 0  # nothing above reached the worker
    ok = client.completions.create(model=model, prompt="still serving?", max_tokens=3,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3
