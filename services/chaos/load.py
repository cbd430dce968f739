"""The steady mixed load: a fixed catalogue of requests (completion and chat, streaming and not, greedy and
seeded sampling, n>1, prompt scoring as lm-eval asks it: echo + logprobs, answers held to a JSON schema), each
sent through the real `openai` client as a whole request, by a client that
cancels (gives up after a fraction of a second) or one that disconnects mid-stream; or by a door that skips
HTTP (services.chaos.jobs: the Python client, whole or cancelled, and Celery tasks; batch files run beside);
plus poison requests (bad bodies the gateway must refuse with a 4xx). Every request's outcome is one `Record`."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = ["Once upon a time, in a land of many rivers,", "The three laws of thermodynamics say",
           "A recipe for bread: first", "def fibonacci(n):", "In the year 2050, cities", "Dear diary, today I",
           "The quick brown fox", "Rain on the window, and"]
MAX_TOKENS = 48  # long enough that faults hit requests mid-way
CLIENT_TIMEOUT_S = 90.0  # no answer within this: the request is lost
UNSCORED = "the prompt's logprobs are missing or incomplete"  # a scoring answer's flaw (check_scored)
SHAPE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
         "required": ["ok", "size"], "additionalProperties": False}  # short whatever the model: never cut
# how a client treats a request: over HTTP whole, cancelled, disconnected mid-stream; or through a door without
# HTTP (services.chaos.jobs): the Python client whole or cancelled with Handle.cancel(), a Celery task
MODES = ("whole", "whole", "whole", "cancel", "disconnect", "python_client", "python_cancel", "celery", "celery")
# bad bodies (merged into a valid one) the gateway refuses before any work
POISON = [{"top_k": 2**63}, {"seed": 2**64}, {"max_tokens": 2**40}, {"temperature": -1},
          {"logit_bias": {"999999999": 1}}, {"n": 10**6}, {"stop": ["x"] * 10**4}]


@dataclass(frozen=True)
class Spec:
    chat: bool
    stream: bool
    prompt: str
    n: int = 1
    seed: int | None = None  # None: greedy
    score: bool = False  # a completion with echo + logprobs: the prompt's logprobs come first (never streamed)
    shaped: bool = False  # the answer held to SHAPE, a JSON schema (response_format)

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "n": self.n, "extra_body": {"ignore_eos": True}}
        body |= {"temperature": 0.8, "seed": self.seed} if self.seed is not None else {"temperature": 0}
        if self.score:
            body |= {"echo": True, "logprobs": 1}
        if self.shaped:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body

    def params(self, model: str) -> dict[str, Any]:
        """The same request as plain parameters: what the Python client, a Celery task or a batch line takes."""
        body = self.body(model)
        return body | body.pop("extra_body")


def catalogue(seed: int, size: int = 16) -> list[Spec]:
    rng = random.Random(seed)
    specs = []
    for i in range(size):
        sampled = i % 2 == 1
        score = i % 8 == 4  # some greedy completions
        specs.append(Spec(chat=i % 4 >= 2, stream=rng.random() < 0.5 and not score, prompt=PROMPTS[i % len(PROMPTS)],
                          n=rng.choice((1, 2)) if sampled else 1, seed=rng.randrange(1000) if sampled else None,
                          score=score, shaped=i % 8 in (3, 6)))  # a sampled chat, a greedy one
    return specs


def check_scored(rec: Record, logprobs: list[dict[str, Any] | None]) -> None:
    """A scoring spec's answer, per choice: the prompt's logprobs before the completion's (the first token's
    null, every other a number), as many as the echoed prompt has tokens and more."""
    for i, lp in enumerate(logprobs):
        values = (lp or {}).get("token_logprobs") or []
        if len(values) <= MAX_TOKENS or values[0] is not None or any(v is None for v in values[1:]):
            rec.order_errors.append(f"choice {i}: {UNSCORED} ({len(values)} token logprobs)")


@dataclass
class Record:
    spec: int  # index into the catalogue; -1 for poison
    mode: str  # one of MODES, "batch" or "poison"
    port: int
    t0: float
    t1: float = 0.0
    outcome: str = ""  # ok, http_error, stream_error, connection_error, refused, lost, cancelled, disconnected
    status: int = 0  # HTTP status of an error answer
    code: str = ""  # OpenAI error code of an error answer or event
    texts: list[str] = field(default_factory=list)  # per choice
    order_errors: list[str] = field(default_factory=list)  # text after a choice finished, none finished, answered twice
    detail: str = ""  # what the client library raised

    @property
    def accepted(self) -> bool:
        return self.outcome not in ("refused", "")


def _error_code(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or "")
    return ""


def _call(client: Any, spec: Spec, model: str, rec: Record, disconnect_after: int | None) -> None:
    body = spec.body(model)
    api = client.chat.completions if spec.chat else client.completions
    if not spec.stream and disconnect_after is None:
        out = api.create(**body)
        choices = sorted(out.choices, key=lambda c: c.index)
        rec.texts = [c.message.content if spec.chat else c.text for c in choices]
        rec.outcome = "ok"
        if spec.score:
            check_scored(rec, [c.logprobs.model_dump() if c.logprobs else None for c in choices])
        return
    texts, finished = [""] * spec.n, [False] * spec.n
    with api.create(**body, stream=True) as stream:
        for count, chunk in enumerate(stream):
            for c in chunk.choices:
                piece = (c.delta.content if spec.chat else c.text) or ""
                if finished[c.index] and piece:
                    rec.order_errors.append(f"choice {c.index} got text after it finished")
                texts[c.index] += piece
                finished[c.index] = finished[c.index] or c.finish_reason is not None
            if disconnect_after is not None and count + 1 >= disconnect_after:
                rec.texts, rec.outcome = texts, "disconnected"
                return
    rec.texts = texts
    rec.outcome = "ok" if all(finished) else "lost"  # a stream that ended with no finish and no error event
    if not all(finished):
        rec.order_errors.append("the stream ended before every choice finished, with no error event")


def send(client: Any, specs: list[Spec], idx: int, mode: str, model: str, port: int, rng: random.Random) -> Record:
    """One request as `mode` asks; every outcome the client can meet lands in the record."""
    import openai

    rec = Record(spec=idx, mode=mode, port=port, t0=time.time())
    spec = specs[idx]
    try:
        if mode == "cancel":
            client = client.with_options(timeout=rng.uniform(0.05, 0.5))
        _call(client, spec, model, rec, rng.randint(1, 4) if mode == "disconnect" else None)
    except openai.APITimeoutError:
        rec.outcome = "cancelled" if mode == "cancel" else "lost"
    except openai.APIStatusError as e:
        rec.outcome, rec.status, rec.code = "http_error", e.status_code, _error_code(e.body)
        if e.status_code == 429 or (e.status_code == 503 and rec.code == "redis_unavailable"):
            rec.outcome = "refused"  # not accepted: nothing to answer
    except openai.APIConnectionError as e:
        # refused at connect (the gateway is down): not accepted; dropped later: an error the client saw. (By
        # name: the openai client may bundle its own copy of httpx.)
        refused = type(e.__cause__).__name__ == "ConnectError"
        rec.outcome, rec.detail = "refused" if refused else "connection_error", repr(e.__cause__)
    except openai.APIError as e:  # an SSE error event
        rec.outcome, rec.code = "stream_error", _error_code(e.body)
    rec.t1 = time.time()
    return rec


def send_poison(base_url: str, api_key: str, model: str, port: int, rng: random.Random) -> Record:
    bad = rng.choice(POISON)
    rec = Record(spec=-1, mode="poison", port=port, t0=time.time(), code=next(iter(bad)))
    body = {"model": model, "prompt": "poison", "max_tokens": 4} | bad
    try:
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {api_key}"})
        rec.status, rec.outcome = r.status_code, "http_error" if r.status_code >= 400 else "ok"
    except httpx.ConnectError:
        rec.outcome = "refused"
    except httpx.HTTPError:
        rec.outcome = "connection_error"
    rec.t1 = time.time()
    return rec
