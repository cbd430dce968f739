"""The fleet through its OpenAI-compatible API: a real Redis (with a password), two real worker processes on
the tiny random-weight model, a real gateway, the real `openai` client. One fleet for the whole module."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fleet_harness import API_KEY, REPO, STOP_PROMPT, Fleet, text_and_a_stop_string

from services.ports import free_port

pytestmark = pytest.mark.integration

BLOCKS = 64


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("fleet-api")) as f:
        f.metrics_port = free_port()
        f.start_worker("w0", "--num-kv-blocks", str(BLOCKS), "--max-num-seqs", "16",
                       "--metrics-port", str(f.metrics_port))
        f.start_worker("w1", "--num-kv-blocks", str(BLOCKS), "--max-num-seqs", "16")
        f.start_gateway("--queue-bound", "2")
        f.wait_ready(workers=2)
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.client(timeout=120)


@pytest.fixture(scope="module")
def model(fleet):
    return os.path.basename(fleet.model)


def _http_get(sock: socket.socket, path: str) -> bytes:
    """One HTTP/1.1 GET on an open connection: the response's status line ('' if the gateway closed it)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            return b""
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n", 1)[0]


def test_an_idle_connection_outlives_the_clients_pools(fleet):
    """The gateway keeps an idle HTTP/1.1 connection open past uvicorn's default 5 s (--timeout-keep-alive, 75
    s): a client whose pool keeps it 5 s (httpx, the openai client) or 15 s (aiohttp) closes it first, and never
    sends a request into one the gateway is closing ("Server disconnected without sending a response")."""
    port = int(fleet.url().rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert _http_get(sock, "/livez") == b"HTTP/1.1 200 OK"
        time.sleep(6)
        assert _http_get(sock, "/livez") == b"HTTP/1.1 200 OK", "the gateway closed an idle connection after 6 s"


def test_health_models_and_fleet_status(fleet, client, model):
    assert httpx.get(fleet.url() + "/health").json() == {"status": "ok", "workers": 2}
    assert httpx.get(fleet.url() + "/livez").status_code == 200
    cards = client.models.list().data
    assert [c.id for c in cards] == [fleet.model] and cards[0].workers == 2 and cards[0].max_model_len == 1024
    snap = fleet.fleet_status()
    assert sorted(w["worker_id"] for w in snap["workers"]) == ["w0", "w1"]
    assert all(w["total_blocks"] == BLOCKS and w["heartbeat_age_s"] < 5 for w in snap["workers"])
    out = subprocess.run([sys.executable, "-m", "services.cli", "status"], cwd=REPO, env=fleet.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "w0" in out.stdout and "w1" in out.stdout and "kvfleet:{s0}:req:any" in out.stdout
    assert "p@ss:word" not in out.stdout + out.stderr
    probes = f"http://127.0.0.1:{fleet.metrics_port}"
    assert httpx.get(probes + "/livez").status_code == 200 and httpx.get(probes + "/readyz").text == "ok\n"
    assert httpx.get(probes + "/metrics").headers["content-type"].startswith("text/plain")


def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(fleet, client):
    """OpenAI's "retrieve model" (`client.models.retrieve`), with the served id as /v1/models lists it (a path here,
    slashes and all, with or without its leading one); another id is a 404 model_not_found that names the served
    one."""
    card = client.models.retrieve(fleet.model)
    assert card.id == fleet.model and card.object == "model" and card.workers == 2 and card.max_model_len == 1024
    assert client.models.retrieve(fleet.model.lstrip("/")).id == fleet.model  # a client that folds the "//"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and fleet.model in e.value.body["message"]


def test_null_fields_take_their_defaults_as_openai_reads_them(fleet, model):
    """Clients that send `"temperature": null` for "not set" (LangChain, hand-written JSON) are served: a null is
    the field's default, as in OpenAI's API. A null for a required field is still a 400 that names it."""
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": None, "top_p": None,
            "n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "seed": 7}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(fleet.url() + "/v1/completions", headers=auth, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 6
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": None,
            "logprobs": None, "stream": None}
    r = httpx.post(fleet.url() + "/v1/chat/completions", headers=auth, json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(fleet.url() + "/v1/completions", headers=auth, json={"model": model, "prompt": None}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_completion_and_its_stream_agree(client, model):
    prompt = "The quick brown fox jumps over the lazy dog because"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "priority": 1})
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 5
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    events = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == choice.text
    finishes = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
    assert finishes == ["length"]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 12


def test_chat_and_its_stream_agree(client, model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_n_choices(client, model):
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, n=3, temperature=0.9,
                                    seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage.completion_tokens == 24
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=0.9, stream=True,
                                            extra_body={"ignore_eos": True})
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_batched_prompts_are_one_request_each(client, model):
    """A list of prompts (texts or token-id lists): one fleet request each, answered as one response whose
    choice i * n + j is prompt i's choice j, with the usage summed; streaming too."""
    prompts = ["The quick brown fox", "Once upon a time there was"]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}) for p in prompts]
    raw = client.completions.with_raw_response.create(model=model, prompt=prompts, max_tokens=5, n=2, temperature=0,
                                                      echo=True, extra_body={"ignore_eos": True})
    out = raw.parse()
    assert len(raw.headers["x-kvfleet-worker"].split(",")) == len(raw.headers["x-kvfleet-prompt-blocks"].split(",")) == 2
    assert out.id == raw.headers["x-request-id"]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [p + s.choices[0].text for p, s in zip(prompts, singles, strict=True)
                                             for _ in range(2)]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == 20 and out.usage.total_tokens == out.usage.prompt_tokens + 20
    ids = client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9, 10, 11]], max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in ids.choices] == [0, 1] and (ids.usage.prompt_tokens, ids.usage.completion_tokens) == (7, 6)
    events = list(client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    for e in events:
        for c in e.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: s.choices[0].text for i, s in enumerate(singles)}
    assert [e.usage.completion_tokens for e in events if e.usage] == [10] and events[-1].choices == []


def test_stop_strings(client, model):
    text, stop = text_and_a_stop_string(client, model)
    out = client.completions.create(model=model, prompt=STOP_PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]


def test_seed_reproducibility(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt="Random words:", max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == chat.message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_get_clear_4xx(fleet, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hello " * 1100, max_tokens=10)
    err = _error(e.value)
    m = re.search(r"maximum context length is (\d+) tokens.*requested (\d+) tokens \((\d+) in the prompt, 10 ",
                  err["message"])
    assert m, err
    assert int(m[1]) == 1024 and int(m[2]) == int(m[3]) + 10 > 1024 and err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5000)
    assert "1024" in _error(e.value)["message"] and "5000" in _error(e.value)["message"]
    for field, value, limit in [("temperature", 5, "2"), ("top_p", 0, "0"), ("n", 0, "1"), ("logprobs", 50, "20"),
                                ("max_tokens", 0, "1")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="x", **{"max_tokens": 4, field: value})
        err = _error(e.value)
        assert err["param"] == field and limit in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"min_p": 3})
    assert _error(e.value)["param"] == "min_p"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    assert _error(e.value)["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert _error(e.value)["code"] == "model_not_found"
    c = openai.OpenAI(base_url=fleet.url() + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.completions.create(model=model, prompt="x", max_tokens=2)
    assert _error(e.value)["code"] == "invalid_api_key"
    missing = httpx.post(fleet.url() + "/v1/completions", json={"model": model, "prompt": "x"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def _sse_lines(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_client_disconnect_frees_blocks(fleet, model):
    body = {"model": model, "prompt": "tell me a very long story " * 12, "max_tokens": 900, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with fleet.http(timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        worker = resp.headers["x-kvfleet-worker"]
        events = _sse_lines(resp)
        for _ in range(3):
            next(events)
        during = fleet.worker_status(worker)
        assert during["running"] == 1 and during["free_blocks"] < BLOCKS
    # the connection is closed: the cancel must reach the worker and free the request's blocks
    fleet.wait_for(lambda: (s := fleet.worker_status(worker))["running"] == 0 and s["free_blocks"] == BLOCKS,
                   timeout_s=10, what=f"{worker} to free its blocks")


def test_overload_answers_429_then_the_fleet_still_serves(fleet, client, model):
    # 400 distinct prompt tokens + 100 output = 32 blocks: one running per 64-block worker (no shared
    # prefixes), 2 more in the shared queue (--queue-bound 2), the rest must get 429.
    rng = random.Random(0)

    def post(_):
        body = {"model": model, "prompt": [rng.randrange(100, 40000) for _ in range(400)], "max_tokens": 100,
                "temperature": 0, "ignore_eos": True}
        with fleet.http(timeout=120) as h:
            r = h.post("/v1/completions", json=body)
            return r.status_code, r.headers.get("retry-after"), r.json()

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(post, range(16)))
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 429}, results
    assert codes.count(429) >= 4 and codes.count(200) >= 4, codes
    for code, retry_after, payload in results:
        if code == 429:
            assert retry_after is not None and int(retry_after) >= 1
            assert payload["error"]["code"] == "fleet_overloaded"
        else:
            assert payload["usage"]["completion_tokens"] == 100
    t0 = time.monotonic()
    ok = client.completions.create(model=model, prompt="still there?", max_tokens=3)
    assert ok.choices[0].text is not None and time.monotonic() - t0 < 30


def test_secrets_never_reach_the_logs(fleet):
    for path in fleet.logs.values():
        text = path.read_text(errors="replace")
        assert API_KEY not in text and "p@ss:word" not in text and "p%40ss" not in text, path


def test_metrics_docs_and_fleet_need_the_api_key(fleet):
    """With API keys set, the operational routes follow them too: 401 without the key, 200 with it."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/metrics", "/v1/fleet", "/docs", "/redoc", "/openapi.json", "/v1/models"):
        denied = httpx.get(fleet.url() + path, timeout=10)
        assert denied.status_code == 401, (path, denied.status_code)
        assert denied.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(fleet.url() + path, headers={"Authorization": "Bearer not-the-key"}, timeout=10)
        assert wrong.status_code == 401, path
        assert httpx.get(fleet.url() + path, headers=auth, timeout=10).status_code == 200, path
    assert "/v1/chat/completions" in httpx.get(fleet.url() + "/openapi.json", headers=auth, timeout=10).json()["paths"]
    for path in ("/health", "/livez"):  # probes carry no key
        assert httpx.get(fleet.url() + path, timeout=10).status_code == 200, path


def test_metrics_open_opens_only_metrics(fleet):
    """KVFLEET_METRICS_OPEN=1 (for scrapers that cannot send a key) opens /metrics and nothing else."""
    fleet.env["KVFLEET_METRICS_OPEN"] = "1"
    try:
        port = fleet.start_gateway()
    finally:
        del fleet.env["KVFLEET_METRICS_OPEN"]
    proc = fleet.gateways[port]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(fleet.url(port) + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        scraped = httpx.get(fleet.url(port) + "/metrics", timeout=10)
        assert scraped.status_code == 200 and "kvfleet_fleet" in scraped.text, fleet.tail()
        for path in ("/v1/fleet", "/docs", "/openapi.json", "/v1/models"):
            assert httpx.get(fleet.url(port) + path, timeout=10).status_code == 401, path
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
        del fleet.gateways[port]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, model, fleet):
    """lm-eval's loglikelihood request (`local-completions`): token-id prompts in a batch, echo, logprobs=1,
    max_tokens=1, greedy. Each choice's logprobs cover the prompt (the first token's null) and then the
    completion; the prompt's equal Hugging Face's on the same weights. Streamed, the prompt's event carries
    the same logprobs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [[5, 6, 7, 8, 9, 10], list(range(300, 340))]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=1, logprobs=1, echo=True,
                                    temperature=0, seed=1234)
    hf = AutoModelForCausalLM.from_pretrained(fleet.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(fleet.model)
    for prompt, choice in zip(prompts, out.choices, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [P, V]
        for i in range(1, len(prompt)):
            assert lp.token_logprobs[i] == pytest.approx(want[i - 1, prompt[i]].item(), abs=2e-3)
            assert max(lp.top_logprobs[i].values()) == pytest.approx(want[i - 1].max().item(), abs=2e-3)
        assert lp.token_logprobs[-1] == pytest.approx(want[-1].max().item(), abs=2e-3)  # greedy: the top one
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert choice.text.startswith(tok.decode(prompt))  # token ids are echoed as their text
    streamed = list(client.completions.create(model=model, prompt="The quick brown fox", max_tokens=3, logprobs=2,
                                              echo=True, temperature=0, stream=True, n=2))
    whole = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=3, logprobs=2,
                                      echo=True, temperature=0, n=2)
    for choice in whole.choices:
        parts = [c for e in streamed for c in e.choices if c.index == choice.index]
        assert "".join(c.text for c in parts) == choice.text and choice.text.startswith("The quick brown fox")
        got = [v for c in parts for v in c.logprobs.token_logprobs]
        assert got[0] is None and got[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)



def test_vllm_prompt_logprobs(client, model, fleet):
    """vLLM's `prompt_logprobs` (extra_body): per prompt token {id: logprob, rank, decoded_token} for the prompt's
    token and the top N, the first null; on chat over the templated prompt. Not with stream: a 400 naming it.
    A response that did not ask has no such field."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = list(range(200, 230))
    out = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    hf = AutoModelForCausalLM.from_pretrained(fleet.model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [P, V]
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], want[i - 1]
        mine = entry[str(prompt[i])]
        assert mine["logprob"] == pytest.approx(row[prompt[i]].item(), abs=2e-3)
        assert abs(mine["rank"] - (int((row > row[prompt[i]]).sum()) + 1)) <= 2  # near-ties may swap
        top = row.topk(2).indices.tolist()
        assert set(entry) == {str(prompt[i]), *map(str, top)}
        assert entry[str(top[0])]["rank"] == 1 or prompt[i] == top[0]
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_dump()
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    lps = chat.choices[0].model_extra["prompt_logprobs"]
    assert lps[0] is None and all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in lps[1:])
    assert len(lps) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs" and "stream" in e.value.body["message"]


def test_structured_outputs(client, model):
    """OpenAI's response_format and vLLM's structured_outputs / guided_*: the answer follows the schema, the
    regex or one of the choices, whatever the (random) model would say; streamed too. A spec that does not compile
    is a 400 from the worker that names it; a malformed one a 400 from the gateway that names the field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Status?"}], max_tokens=40, temperature=0.9, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "status", "schema": schema}})
    answer = json.loads(chat.choices[0].message.content)
    assert set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool) and answer["n"] in (1, 2, 3)
    assert chat.choices[0].finish_reason == "stop"
    out = client.completions.create(model=model, prompt="Pick:", max_tokens=20, n=3, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}})
    assert all(c.text in ("alpha", "beta", "gamma delta") and c.finish_reason == "stop" for c in out.choices)
    stream = client.completions.create(model=model, prompt="Code:", max_tokens=20, temperature=0, stream=True,
                                       extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", "".join(c.choices[0].text for c in stream if c.choices))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"guided_regex": "a(b"})
    assert "guided" not in e.value.message and "regex" in e.value.message and "does not compile" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"json": "{"}})
    assert e.value.body["param"] == "structured_outputs.json"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]})
    assert "only one of" in e.value.body["message"]


def test_tool_calls_required_or_named(client, model):
    """tool_choice "required" or a named function: the answer is a call (or calls) whose arguments follow the
    function's parameters schema, in OpenAI's tool_calls shape, streamed or not; "auto" (the default with tools)
    is a 400 naming tool_choice on a gateway started without --enable-auto-tool-choice (tests/e2e: with it)."""
    tools = [{"type": "function", "function": {"name": "set_light", "description": "Turn a light on or off",
              "parameters": {"type": "object", "properties": {"on": {"type": "boolean"},
                                                              "room": {"enum": ["kitchen", "hall"]}},
                             "required": ["on", "room"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "ping", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "Lights on in the kitchen"}]
    named = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "set_light"}})
    (call,) = named.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "set_light" and call.id.startswith("call_") and call.type == "function"
    assert set(args) == {"on", "room"} and args["room"] in ("kitchen", "hall") and isinstance(args["on"], bool)
    assert named.choices[0].message.content is None and named.choices[0].finish_reason == "stop"
    required = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                              max_tokens=200, temperature=0.8, seed=3)
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("set_light", "ping") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    assert required.choices[0].finish_reason == "tool_calls"
    events = list(client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=60,
                                                 tool_choice={"type": "function", "function": {"name": "set_light"}},
                                                 stream=True))
    deltas = [c.delta.tool_calls for e in events for c in e.choices if c.delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0 and deltas[0][0].function.name == "set_light"
    assert set(json.loads(deltas[0][0].function.arguments)) == {"on", "room"}
    assert [c.finish_reason for e in events for c in e.choices if c.finish_reason] == ["stop"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "auto" in e.value.body["message"]

def test_continuous_usage_stats_count_each_choice_as_it_streams(client, model):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far, and the last
    (include_usage) the request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    batch = list(client.completions.create(model=model, prompt=["One two", "Three four five"], n=2, max_tokens=5,
                                           stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2,
                                               max_tokens=5, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    for events, choices in ((batch, 4), (chat, 2)):  # a batch's choice i * n + j: prompt i's sample j
        counted: dict[int, list[int]] = {}
        prompts: dict[int, int] = {}
        for e in events[:-1]:
            if not e.choices:
                continue
            (c,) = e.choices
            counted.setdefault(c.index, []).append(e.usage.completion_tokens)
            prompts[c.index] = e.usage.prompt_tokens
            assert e.usage.total_tokens == e.usage.prompt_tokens + e.usage.completion_tokens
        assert sorted(counted) == list(range(choices))
        assert all(seq == sorted(seq) and seq[-1] == 5 for seq in counted.values()), counted
        final = events[-1].usage  # each prompt counted once, as in a response that is not streamed
        assert final.completion_tokens == 5 * choices and 2 * final.prompt_tokens == sum(prompts.values())
    plain = list(client.completions.create(model=model, prompt="x", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(e.usage is None for e in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_tokenize_and_detokenize_as_vllm(fleet, client, model):
    """vLLM's /tokenize and /detokenize: the ids a prompt or chat messages become are the ones the generation
    endpoints count (usage.prompt_tokens), and come back to the text; bad input is a 400 naming the field."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "user", "content": "Count the tokens of this chat"}]
    chat = httpx.post(fleet.url() + "/tokenize", headers=headers, json={"model": model, "messages": messages}).json()
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert chat["count"] == len(chat["tokens"]) == reply.usage.prompt_tokens and chat["max_model_len"] == 1024
    prompt = "The quick brown fox"
    text = httpx.post(fleet.url() + "/tokenize", headers=headers,
                      json={"model": model, "prompt": prompt, "return_token_strs": True}).json()
    done = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert text["count"] == done.usage.prompt_tokens and len(text["token_strs"]) == text["count"]
    back = httpx.post(fleet.url() + "/detokenize", headers=headers, json={"model": model, "tokens": text["tokens"]})
    assert prompt in back.json()["prompt"]
    for path, body, param in [("/tokenize", {"model": model}, "prompt"),
                              ("/tokenize", {"model": model, "messages": messages, "continue_final_message": True},
                               "continue_final_message"),
                              ("/detokenize", {"model": model, "tokens": [1, 10**7]}, "tokens[1]"),
                              ("/detokenize", {"model": model, "tokens": [-1]}, "tokens[0]")]:
        bad = httpx.post(fleet.url() + path, headers=headers, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, body, bad.text)
    assert httpx.post(fleet.url() + "/tokenize", json={"model": model, "prompt": "x"}).status_code == 401


def test_a_status_this_version_cannot_read_leaves_the_rest_of_the_fleet_serving(fleet, client, model):
    """A worker of another kvfleet version (a rolling upgrade) registers and publishes a status this version cannot
    read. It used to stop the fleet: every request a 500, /health 503, `kvfleet status` a traceback, and the
    workers' takeover scans an error each heartbeat. Now that worker is left out, neither routed to nor taken for
    dead (what is pending on it stays there), said once in the log and shown apart; the rest serves."""
    from shared import keys, streams

    r = streams.connect(fleet.redis.url)
    stream = keys.req_stream("w-next")
    try:
        r.sadd(keys.workers(), "w-next")
        r.set(keys.status("w-next"), json.dumps({"worker_id": "w-next", "kv": {"free": 9}}), px=60_000)
        r.xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
        r.xadd(stream, {"request": "{}"})
        r.xreadgroup(keys.GROUP, "w-next", {stream: ">"}, count=1)  # pending on it: a takeover would claim it
        out = client.completions.create(model=model, prompt="still serving?", max_tokens=4)
        assert out.usage.completion_tokens == 4
        assert httpx.get(fleet.url() + "/health").json() == {"status": "ok", "workers": 2}
        snap = fleet.fleet_status()
        assert sorted(w["worker_id"] for w in snap["workers"]) == ["w0", "w1"] and snap["dead_workers"] == []
        assert snap["unreadable_workers"] == {"w-next": "model: Field required (and 4 more)"}, snap
        status = subprocess.run([sys.executable, "-m", "services.cli", "status"], cwd=REPO, env=fleet.env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "unreadable: w-next's status (model: Field required" in \
            status.stdout, status.stdout + status.stderr
        time.sleep(3)  # takeover scans of both workers (one a heartbeat)
        assert r.xpending(stream, keys.GROUP)["consumers"] == [{"name": "w-next", "pending": 1}]
        gateway_log = next(p for name, p in fleet.logs.items() if name.startswith("gateway"))
        assert gateway_log.read_text().count("the status of worker w-next cannot be read") == 1, fleet.tail()
        for wid in ("w0", "w1"):
            assert "unexpected error" not in fleet.logs[wid].read_text(), fleet.tail()
    finally:
        r.delete(keys.status("w-next"), stream)
        r.srem(keys.workers(), "w-next")
        r.close()


def test_no_live_worker_then_no_redis_answer_503(fleet, client, model):  # last: it stops the fleet
    """Last in the module: it stops the fleet's workers, then its Redis."""
    for wid in ("w0", "w1"):
        fleet.signal_worker(wid, signal.SIGTERM)  # graceful: each removes its status as it exits
    for wid in ("w0", "w1"):
        assert fleet.workers[wid].wait(30) == 0
    # they left nothing to take over, so they left the fleet (streams.leave): not dead workers to wait for
    assert fleet.fleet_status()["dead_workers"] == []
    health = httpx.get(fleet.url() + "/health")
    assert health.status_code == 503 and health.json()["reason"] == "no live worker"
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=model, prompt="anyone?", max_tokens=2)
    assert e.value.status_code == 503 and _error(e.value)["code"] == "no_workers"
    fleet.redis.stop()
    assert httpx.get(fleet.url() + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=model, prompt="anyone?", max_tokens=2)
    assert e.value.status_code == 503 and _error(e.value)["code"] == "redis_unavailable"

