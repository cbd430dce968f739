"""The fuzz tier: schemathesis generates requests from the gateway's own OpenAPI schema (/openapi.json) and sends
them, with the API key, to a real fleet (tests/fuzz/conftest.py). Both kinds of case: bodies that fit the
schema (they reach the tokenizer, the router and the worker) and bodies that break it (wrong types, missing
fields, out-of-range values). Every response must be below 500; every 4xx in OpenAI's error shape; every SSE
event readable JSON, a stream ending in [DONE]; and no process of the fleet may exit. At the end a good
request must still work.

Every endpoint gets schemathesis's coverage phase (bounds, types, methods and media types, enumerated); the two
generation endpoints also get drawn cases, KVFLEET_FUZZ_EXAMPLES per endpoint and kind (fitting the schema or
breaking it; default 150, CI's run). A long run:

    KVFLEET_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -m fuzz tests/fuzz -p no:cacheprovider

A failure prints the shrunk case and a curl command to replay it; `--hypothesis-seed N` reruns one run.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import httpx
import pytest
import schemathesis
from fleet_harness import API_KEY
from fuzz_fleet import assert_alive, assert_openai_error, assert_serves, vocab_size
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

EXAMPLES = int(os.environ.get("KVFLEET_FUZZ_EXAMPLES", "150"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GENERATIONS = ("/v1/completions", "/v1/chat/completions")
TOKENIZING = ("/tokenize", "/detokenize")  # vLLM's
POSTS = GENERATIONS + TOKENIZING
READS = ("/v1/models", "/v1/models/{model}", "/v1/fleet", "/health", "/readyz", "/livez", "/metrics")
OUTPUT_CAP = 4  # output tokens of a case that fits the schema: cheap to run, whatever max_tokens said
CAPS = {"max_tokens": OUTPUT_CAP, "max_completion_tokens": OUTPUT_CAP, "n": 2, "best_of": 2}
BATCH_CAP = 4  # prompts of a completion batch
INT_EXTREMES = (2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**31) - 1, -(2**63) - 1, 10**30)
FLOAT_EXTREMES = (1e308, -1e308, 5e-324, -0.0)  # NaN and Infinity: tests/fuzz/test_rejected_input.py (JSON has none)


@pytest.fixture(scope="module")
def api_schema(fuzz_fleet):
    schema = schemathesis.openapi.from_url(fuzz_fleet.url() + "/openapi.json", headers=AUTH, timeout=30)
    for path in POSTS + READS:
        assert schema[path], f"{path} is missing from the gateway's OpenAPI schema"
    return schema


def whole(value) -> bool:
    """An integer as JSON may carry it (4 or 4.0), which the gateway reads as an int."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
        and value == int(value)


def cheap(body: dict) -> None:
    """Make a generated body cheap to serve without making a bad one good: only values the gateway accepts are
    lowered (max_tokens 1000 -> 4, n 64 -> 2; max_tokens 0 or "x" stay as they are)."""
    wanted = body.get("max_tokens")
    for key, cap in CAPS.items():
        if whole(body.get(key)) and body[key] > cap:
            body[key] = cap
    for key in ("max_tokens", "max_completion_tokens"):  # None: up to the context window
        if key in body and body[key] is None:
            body[key] = OUTPUT_CAP
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = OUTPUT_CAP
    low = body.get("min_tokens")
    if whole(low) and whole(wanted) and 0 <= low <= wanted:  # keep min <= max as it was
        body["min_tokens"] = min(low, body["max_tokens"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        body["prompt"] = prompt[:BATCH_CAP]


def into_vocab(value, vocab: int):
    """Whole numbers >= 0, anywhere in a list, moved into the vocabulary (types kept: 4.0 stays a float)."""
    if isinstance(value, list):
        return [into_vocab(v, vocab) for v in value]
    if whole(value) and value >= 0:
        return type(value)(int(value) % vocab)
    return value


def steer(body: dict, model: str, vocab: int) -> None:
    """Most bodies get past the first checks into tokenizing, validation and the worker: the served model's
    name, a prompt that is not empty, token ids (prompt, stop_token_ids, logit_bias keys) inside the vocabulary."""
    if isinstance(body.get("model"), str):
        body["model"] = model
    if body.get("prompt") in ("", []):  # the schema allows it; the gateway's "the prompt is empty" 400 stops it
        body["prompt"] = "hi"
    for key in ("prompt", "stop_token_ids", "tokens"):
        if key in body:
            body[key] = into_vocab(body[key], vocab)
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        body["logit_bias"] = {str(i * 7919 % vocab): v for i, v in enumerate(bias.values())}


def push_to_an_extreme(body: dict, data) -> None:
    """1 case in 4: one number of the body (a field, or the first of a list of them: token ids) becomes a value
    past what 32 or 64 bits hold, or the largest and smallest floats. The schema's generators seldom reach them
    when a field has no maximum, and they are what overflows further down (`torch.tensor([top_k])`)."""
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    fields = sorted(k for k, v in body.items() if number(v) or isinstance(v, list) and v and number(v[0]))
    if not fields or data.draw(st.integers(0, 3), label="extreme") < 3:
        return
    key = data.draw(st.sampled_from(fields), label="extreme field")
    value = body[key][0] if isinstance(body[key], list) else body[key]
    extreme = data.draw(st.sampled_from(INT_EXTREMES if whole(value) else FLOAT_EXTREMES), label="extreme value")
    if isinstance(body[key], list):
        body[key] = [extreme, *body[key][1:]]
    else:
        body[key] = extreme


def numeric_fields(raw_schema: dict, path: str) -> dict[str, str]:
    """{field: "integer" or "number"} of the request body of POST `path`, read from the OpenAPI document."""
    ref = raw_schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    props = raw_schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    kinds = {}
    for name, prop in props.items():
        types = {p.get("type") for p in prop.get("anyOf", [prop])} & {"integer", "number"}
        if types:
            kinds[name] = "integer" if types == {"integer"} else "number"
    return kinds


def check(status: int, content_type: str, content: bytes, cut_short: bool) -> None:
    assert status < 500, f"server error {status}: {content[:2000]!r}"
    if 400 <= status < 500:
        assert_openai_error(status, content)
    elif content_type.startswith("text/event-stream"):
        events = [line[len(b"data: "):] for line in content.split(b"\n") if line.startswith(b"data: ")]
        assert cut_short or events[-1:] == [b"[DONE]"], f"a stream without [DONE]: {content[-500:]!r}"
        for event in events:
            if event != b"[DONE]":
                doc = json.loads(event)  # an unreadable chunk fails here
                if "error" in doc:
                    assert_openai_error(status, event)
    elif content_type.startswith("application/json"):
        json.loads(content)


def send(fleet, case) -> int:
    """Sends one case with the API key; checks the response and the fleet; returns the status."""
    response = case.call(base_url=fleet.url(), headers=AUTH, timeout=60)
    check(response.status_code, (response.headers.get("content-type") or [""])[0], response.content,
          response.stream_cut_short)
    assert_alive(fleet)
    return response.status_code


def report(operation, kind: str, statuses: Counter[int]) -> None:
    print(f"{operation.method.upper()} {operation.path} {kind}: HTTP status -> cases {dict(statuses)}")


@pytest.mark.parametrize("path", POSTS + READS)
def test_coverage_cases(fleet, api_schema, path):
    """Schemathesis's coverage phase: each field at and past its bounds, wrong types, missing required fields,
    other methods and media types, enumerated rather than drawn."""
    operation = api_schema[path]["POST" if path in POSTS else "GET"]
    config = api_schema.config.generation_for(operation=operation)
    vocab, statuses = vocab_size(fleet), Counter()
    for case in api_schema.iter_coverage_cases(operation, generation_config=config,
                                               generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE]):
        positive = case.meta and case.meta.generation.mode == GenerationMode.POSITIVE
        if positive and isinstance(case.body, dict):
            cheap(case.body)
            steer(case.body, fleet.model, vocab)
        if positive and "model" in (case.path_parameters or {}) and not statuses[200]:
            case.path_parameters["model"] = fleet.model  # one served case; the others ask for the ids drawn
        statuses[send(fleet, case)] += 1
    report(operation, "coverage", statuses)
    assert statuses[200] > 0, f"no case was served: {dict(statuses)}"


@pytest.mark.parametrize("path", GENERATIONS)
def test_extreme_numbers(fleet, api_schema, path):
    """Every number field of the body (as the schema lists them) at each extreme, over a good body: 400 (or
    served, where the value is in range), never a 5xx or a dead worker."""
    fields = numeric_fields(api_schema.raw_schema, path)
    assert {"max_tokens", "n", "top_k", "seed", "priority"} <= set(fields), fields
    good = {"model": fleet.model, "max_tokens": OUTPUT_CAP}
    good |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    statuses: Counter[int] = Counter()
    with httpx.Client(base_url=fleet.url(), headers=AUTH, timeout=60) as http:
        for field, kind in sorted(fields.items()):
            for value in INT_EXTREMES + (FLOAT_EXTREMES if kind == "number" else ()):
                r = http.post(path, json=good | {field: value})
                check(r.status_code, r.headers.get("content-type", ""), r.content, cut_short=False)
                assert_alive(fleet)
                statuses[r.status_code] += 1
    print(f"POST {path} extremes: HTTP status -> cases {dict(statuses)}")
    assert_serves(fleet)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("path", POSTS)
def test_generated_cases(fleet, api_schema, path, mode):
    """KVFLEET_FUZZ_EXAMPLES drawn cases; those that fit the schema are made cheap, 9 in 10 steered, 1 in 4 given
    an extreme number."""
    operation = api_schema[path]["POST"]
    strategy = operation.as_strategy(generation_mode=mode)
    vocab, statuses = vocab_size(fleet), Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_case(data):
        case = data.draw(strategy, label="case")
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):  # negative ones go as generated
            cheap(case.body)
            if data.draw(st.integers(0, 9), label="as generated") < 9:  # the simplest draw (0) steers
                steer(case.body, fleet.model, vocab)
            push_to_an_extreme(case.body, data)
        statuses[send(fleet, case)] += 1

    one_case()
    report(operation, mode, statuses)
    if mode == GenerationMode.POSITIVE:  # the cases reached the worker, not only the validation
        assert statuses[200] > 0, f"no generated case was served: {dict(statuses)}"
    assert_serves(fleet)
