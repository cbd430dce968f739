"""Bad input is refused before any work, naming the field and the limit: the request models' bounds, the checks
against the model's vocabulary in prepare(), SamplingParams' own bounds (the offline API and the worker), the
body-size limit in front of the app, and the tokenizer threads."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import pytest
from fastapi import Body, Depends, FastAPI
from pydantic import ValidationError

from gateway.chat_api import ChatCompletionRequest
from gateway.errors import APIError, install_handlers, validation_error
from gateway.middleware import BodyLimit
from gateway.openai_api import CompletionRequest
from gateway.prompts import prepare
from gateway.tokenizer import Tokenizers
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BIG = 2**63  # the value that once killed a worker in torch.tensor([top_k])


def refused(body: dict, chat: bool = False) -> tuple[str | None, str]:
    model = ChatCompletionRequest if chat else CompletionRequest
    with pytest.raises(ValidationError) as e:
        model.model_validate({"model": "m"} | ({"messages": [{"role": "user", "content": "hi"}]} if chat else
                                                {"prompt": "hi"}) | body)
    return validation_error(e.value)


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("top_k", BIG, "2147483647"), ("top_k", -2, "-1"), ("n", 65, "64"), ("n", 0, "1"), ("best_of", 65, "64"),
    ("logprobs", 21, "20"), ("max_tokens", 0, "1"), ("max_tokens", BIG, "2147483647"), ("min_tokens", -1, "0"),
    ("min_tokens", BIG, "2147483647"), ("priority", 2**31, "2147483647"), ("priority", -(2**31) - 1, "-2147483648"),
    ("seed", 2**63, "9223372036854775807"), ("seed", -(2**63) - 1, "-9223372036854775808"),
    ("temperature", 2.5, "2"), ("temperature", float("nan"), "2"), ("top_p", 0, "0"), ("min_p", 1.5, "1"),
    ("presence_penalty", -3, "-2"), ("frequency_penalty", float("inf"), "2"), ("repetition_penalty", 0, "0"),
    ("repetition_penalty", 11, "10"),
])
def test_each_numeric_field_has_bounds(field, value, limit):
    param, message = refused({field: value})
    assert param == field and limit in message, message


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"top_logprobs": 21}, "top_logprobs", "20"),
    ({"max_completion_tokens": BIG}, "max_completion_tokens", "2147483647"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
     "messages[0].content[1].type", "'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "string"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]", "object"),
    ({"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages[0].content", "surrogate"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt false"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the request"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     "set by the request"),
])
def test_chat_fields_and_content_parts(body, param, words):
    got, message = refused(body, chat=True)
    assert got == param and words in message, message


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"stop": ["x"] * 17}, "stop", "at most 16"),
    ({"stop": ["ok", "y" * 257]}, "stop[1]", "1 to 256 characters"),
    ({"stop": ""}, "stop", "1 to 256"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids[1]", "0"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids", "256"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x", "token ids"),
    ({"best_of": 2, "n": 1}, "best_of", "must equal n"),
    ({"suffix": "}"}, "suffix", "not supported"),
    ({"prompt": [[1, -5]]}, "prompt[0][1]", "0"),
    ({"prompt": "\udfff"}, "prompt", "surrogate"),
    ({"user": "ok", "stop": ["\ud83d"]}, "stop[0]", "surrogate"),
])
def test_completion_lists_strings_and_maps(body, param, words):
    got, message = refused(body)
    assert got == param and words in message, message


@pytest.mark.parametrize("raw", [rb'"\ud800"', rb'"a \udfff b"', rb'"\ud83d\u0041"', rb'["ok", "\udbff"]'])
def test_the_json_parser_refuses_lone_surrogates_itself(raw):
    """Validated from JSON (the fast lane), the surrogate walk is skipped: pydantic's parser refuses a lone one
    itself, and the fast lane then hands the body to the app, whose json.loads keeps it, so the walk names the
    field (tests/integration/test_bad_input.py). A pair stays valid."""
    with pytest.raises(ValidationError, match="surrogate|hex escape"):
        CompletionRequest.model_validate_json(b'{"model": "m", "prompt": "hi", "stop": %s}' % raw)
    ok = CompletionRequest.model_validate_json(rb'{"model": "m", "prompt": "\ud83d\ude00"}')
    assert ok.prompt == "\U0001f600"


def test_valid_extremes_pass():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "top_k": -1, "seed": -(2**63),
                                             "priority": 2**31 - 1, "stop": ["s" * 256] * 16, "best_of": 3, "n": 3,
                                             "logit_bias": {}})
    params = body.sampling_params(16, None)
    assert params.top_k == 0 and params.seed == -(2**63) and len(params.stop) == 16
    assert SamplingParams(seed=2**63 - 1, n=64).seed == 2**63 - 1  # seed + choice index still fits the generator


@pytest.mark.parametrize(("kw", "param"), [
    ({"top_k": BIG}, "top_k"), ({"seed": 2**64}, "seed"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"), ({"repetition_penalty": 10**400}, "repetition_penalty"),
    ({"stop_token_ids": [BIG]}, "stop_token_ids"), ({"stop": ["x" * 257]}, "stop"), ({"n": 65}, "n"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"structured_outputs": {"regex": "a", "json": "{}"}},
                                                   "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"] * 257}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"grammar": "x" * 40_000}}, "structured_outputs.grammar"),
])
def test_sampling_params_bound_every_field(kw, param):
    """The offline API and the worker build SamplingParams too: no value reaches a tensor unbounded."""
    with pytest.raises(ValueError, match=f"^{param}"):
        SamplingParams(**kw)


def test_tiny_temperatures_sample_at_the_smallest_safe_one():
    assert SamplingParams(temperature=1e-300).temperature == 0.01 and SamplingParams(temperature=0).greedy


# ---- prepare(): what needs the model -----------------------------------------------------------------

class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __len__(self) -> int:
        return 100

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % 100 for c in text]}


def target() -> SimpleNamespace:
    return SimpleNamespace(tokenizer=FakeTokenizer(), workers=[object()], max_model_len=64)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"top_k": 101}, "top_k", "[1, 100]"),
    ({"stop_token_ids": [5, 100]}, "stop_token_ids[1]", "[0, 100)"),
    ({"logit_bias": {"100": 1}}, "logit_bias.100", "[0, 100)"),
    ({"prompt": [1, 2, 100]}, "prompt", "[0, 100)"),
    ({"max_tokens": 100}, "prompt", "maximum context length is 64"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "<= max_tokens"),
])
def test_prepare_checks_against_the_vocabulary_and_window(body, param, words):
    with pytest.raises(APIError) as e:
        prepare(target(), CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | body))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_prepare_takes_the_vocabularys_edges():
    body = CompletionRequest.model_validate({"model": "m", "prompt": [0, 99], "top_k": 100,
                                             "stop_token_ids": [99], "max_tokens": 62})
    (prompt,) = prepare(target(), body).prompts
    assert prompt.token_ids == [0, 99] and prompt.params.top_k == 100 and prompt.params.stop_token_ids == [99]


def test_logit_bias_reaches_the_sampling_params_with_int_keys():
    body = CompletionRequest.model_validate({"model": "m", "prompt": [1], "logit_bias": {"0": -100, "99": 2.5}})
    (prompt,) = prepare(target(), body).prompts
    assert prompt.params.logit_bias == {0: -100, 99: 2.5}
    wire = SamplingParams.from_dict(json.loads(json.dumps(prompt.params.to_dict())))  # keys become strings
    assert wire.logit_bias == {0: -100, 99: 2.5}


def test_tokenizing_runs_off_the_event_loop():
    async def main() -> tuple[int, int]:
        tokenizers = Tokenizers(threads=2)
        try:
            return threading.get_ident(), await tokenizers.run(threading.get_ident)
        finally:
            tokenizers.close()

    loop_thread, worker_thread = asyncio.run(main())
    assert loop_thread != worker_thread
    with pytest.raises(ValueError, match="tokenizer_threads"):
        Tokenizers(threads=0)


# ---- the body limit ----------------------------------------------------------------------------------

def limited_app(max_bytes: int) -> tuple[FastAPI, list[dict]]:
    seen: list[dict] = []
    app = FastAPI()
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_bytes)

    def key_check() -> None:
        raise APIError(401, "no key", code="invalid_api_key")

    @app.post("/echo")
    async def echo(body: dict = Body(...)) -> dict:
        seen.append(body)
        return body

    @app.post("/keyed", dependencies=[Depends(key_check)])
    async def keyed(body: dict = Body(...)) -> dict:
        return body

    return app, seen


def test_bodies_over_the_limit_get_413_before_parsing_or_the_key_check():
    app, seen = limited_app(1000)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            small = await c.post("/echo", json={"a": "x" * 100})
            big = await c.post("/keyed", json={"a": "x" * 2000})  # Content-Length over: not even the key check

            async def chunks():  # no Content-Length: counted as it is read
                for _ in range(30):
                    yield b" " * 100

            chunked = await c.post("/echo", content=chunks(), headers={"content-type": "application/json"})
            bad_utf8 = await c.post("/echo", content=b'{"a": "\xff"}', headers={"content-type": "application/json"})
            return [small, big, chunked, bad_utf8]

    small, big, chunked, bad_utf8 = asyncio.run(main())
    assert small.status_code == 200 and seen == [{"a": "x" * 100}]
    for r in (big, chunked):
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "request_too_large" and "1000" in err["message"], r.text
        assert set(err) == {"message", "type", "param", "code"}
    assert "is 2008 bytes" in big.json()["error"]["message"]
    assert bad_utf8.status_code == 400 and "UTF-8" in bad_utf8.json()["error"]["message"]
    assert seen == [{"a": "x" * 100}]


def test_sampling_params_to_dict_is_asdicts_copy_and_round_trips():
    import dataclasses

    p = SamplingParams(n=2, stop="x", stop_token_ids=[7], logit_bias={"5": 1.5}, seed=3, max_tokens=None)
    d = p.to_dict()
    assert d == dataclasses.asdict(p)
    d["stop"].append("y")
    d["stop_token_ids"].append(8)
    d["logit_bias"][6] = 2.0
    assert (p.stop, p.stop_token_ids, p.logit_bias) == (["x"], [7], {5: 1.5})  # a copy, not a view
    assert SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_choice": []}, "guided_choice", "1 to 256"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "only one of"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream"),
])
def test_structured_outputs_and_prompt_logprobs_fields(body, param, words):
    got_param, message = refused(body)
    assert got_param == param and words in message, (got_param, message)


def test_structured_outputs_reach_the_sampling_params_in_one_form():
    """Every way of asking gives the worker one spec; a schema object becomes its compact JSON text."""
    def spec(**body):
        return CompletionRequest(model="m", prompt="x", **body).sampling_params(8, None).structured_outputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = json.dumps(schema, separators=(",", ":"))
    assert spec(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == {"json": text}
    assert spec(guided_json=schema) == spec(structured_outputs={"json": schema}) == {"json": text}
    assert spec(response_format={"type": "json_object"}) == {"json_object": True}
    assert spec(response_format={"type": "text"}) is None and spec() is None
    assert spec(guided_choice=["a", "b"]) == {"choice": ["a", "b"]}
    assert spec(guided_grammar='root ::= "x"') == {"grammar": 'root ::= "x"'}


def test_unknown_fields_are_ignored_and_named_once(caplog):
    """As vLLM: a field this API does not know (a newer client's, a provider's extension) is no error, but the
    gateway names it in a warning, once per process; an empty suffix is no suffix."""
    body = {"model": "m", "prompt": "hi", "suffix": "", "kvfleet_test_unknown": 1, "kvfleet_test_other": {"a": 1}}
    with caplog.at_level("WARNING", logger="kvfleet.gateway"):
        for _ in range(3):
            assert CompletionRequest.model_validate(body).suffix == ""
    warned = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert warned == ["CompletionRequest: ignoring field(s) this API does not know: kvfleet_test_other, "
                      "kvfleet_test_unknown (each named once)"], warned


def test_a_body_that_is_no_json_object_and_an_unknown_endpoint_are_named():
    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {"model": body.model}

    async def main() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            post = lambda raw: c.post("/v1/chat/completions", content=raw,  # noqa: E731
                                      headers={"content-type": "application/json"})
            return {"broken": await post(b'{"model": "m",}'), "array": await post(b"[]"),
                    "string": await post(b'"hi"'), "empty": await post(b""),
                    "other path": await c.post("/v1/embeddings", json={"input": "x"}),
                    "other method": await c.get("/v1/chat/completions")}

    r = asyncio.run(main())
    for name, resp in r.items():
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}, name
    broken = r["broken"].json()["error"]
    assert r["broken"].status_code == 400 and broken["param"] is None
    assert broken["message"].startswith("the request body is not valid JSON: Expecting property name"), broken
    assert "at character 14" in broken["message"], broken
    for name, got in (("array", "a JSON array"), ("string", "a JSON string"), ("empty", "nothing")):
        err = r[name].json()["error"]
        assert r[name].status_code == 400 and err["message"].endswith(f"must be a JSON object (its fields: model, "
                                                                       f"messages or prompt, ...), got {got}"), err
    other = r["other path"].json()["error"]
    assert r["other path"].status_code == 404 and other["code"] == "not_found"
    assert other["message"] == "no such endpoint: POST /v1/embeddings; this gateway serves POST /v1/chat/completions"
    method = r["other method"].json()["error"]
    assert r["other method"].status_code == 405 and method["type"] == "invalid_request_error"
    assert method["message"].startswith("this method is not allowed on this path: GET /v1/chat/completions;"), method


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_null_field_takes_its_default_as_in_openais_api(chat):
    """`"temperature": null` means "not set" in OpenAI's API (its fields are "number or null"): the default, not a
    400. A field whose default is null keeps the null (max_tokens: no cap but the context window); a required
    field's null is still refused, naming it."""
    model = ChatCompletionRequest if chat else CompletionRequest
    given = {"model": "m"} | ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    nulls = {"temperature": None, "top_p": None, "n": None, "top_k": None, "min_p": None, "stream": None,
             "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None, "priority": None,
             "ignore_eos": None, "skip_special_tokens": None, "max_tokens": None, "stop": None, "seed": None}
    body = model.model_validate(given | nulls)
    default = model.model_validate(given)
    for field in nulls:
        if field == "max_tokens":
            assert body.max_tokens is None
        else:
            assert getattr(body, field) == getattr(default, field), field
    assert model.model_validate_json(json.dumps(given | nulls)) == body  # the fast lane parses JSON itself
    with pytest.raises(ValidationError) as e:
        model.model_validate(given | {"model": None})
    assert validation_error(e.value)[0] == "model"
    assert refused({"temperature": "hot"}, chat)[0] == "temperature"  # a wrong value is still refused
