"""The load of `kvfleet bench serve`: requests sent to an OpenAI-compatible `/v1/completions` at their arrival
times (Poisson at a rate, or all at once), at most `concurrency` in flight, each streamed and timed.

One request: `stream: true` with `stream_options.include_usage`, greedy (or the endpoint's sampling), `ignore_eos`, `max_tokens` =
`min_tokens` = its output length, the prompt as token ids. Its TTFT is the time to the first event with a
choice in it, each later such event adds one inter-token latency (as vLLM's benchmark_serving counts them),
and its output tokens are the usage event's `completion_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from services.bench.stats import poisson_arrivals
from services.bench.workload import BenchRequest


@dataclass
class RequestResult:
    id: int
    prompt_tokens: int
    expected_output_tokens: int
    start_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0  # the usage event's completion_tokens
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None  # None: it succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None for a 1-token request."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration_s: float  # first send to last answer
    client_cpu_s: float = 0.0  # CPU time this process (the load generator) spent meanwhile: on a small machine
    # it competes with the server for the same cores


@dataclass(frozen=True)
class Endpoint:
    url: str  # the server's root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the name sent as "model"
    api_key: str | None = None
    replicas: tuple[str, ...] = ()  # more roots of the same service (gateway replicas): requests go round-robin
    # over url and these, as a Kubernetes Service spreads them
    sampling: dict | None = None  # temperature / top_p / top_k of every request; None: greedy

    @property
    def urls(self) -> tuple[str, ...]:
        return (self.url, *self.replicas)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def shifted(requests: Sequence[BenchRequest], offset: int, vocab_size: int) -> list[BenchRequest]:
    """The requests with every prompt token id moved by `offset` (mod vocab_size): same lengths, same shared
    prefixes, different prompts. offset 0: the requests themselves."""
    if offset % vocab_size == 0:
        return list(requests)
    return [BenchRequest(r.id, [(t + offset) % vocab_size for t in r.prompt_token_ids], r.output_len)
            for r in requests]


def completion_body(model: str, req: BenchRequest, sampling: dict | None = None) -> dict:
    return {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "min_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0, **(sampling or {}), "stream": True,
            "stream_options": {"include_usage": True}}


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {message}"


async def send_one(client: httpx.AsyncClient, ep: Endpoint, req: BenchRequest, t0: float) -> RequestResult:
    """Send one streamed completion and time it; failures are recorded in `.error`, never raised."""
    res = RequestResult(id=req.id, prompt_tokens=len(req.prompt_token_ids), expected_output_tokens=req.output_len)
    sent = time.perf_counter()
    res.start_s = sent - t0
    last = sent
    buf = b""
    try:
        async with client.stream("POST", "/v1/completions", json=completion_body(ep.model, req, ep.sampling),
                                 headers=ep.headers()) as resp:
            if resp.status_code != 200:
                res.error = _error_text(resp.status_code, await resp.aread())
                return res
            async for data in resp.aiter_bytes():
                now = time.perf_counter()
                buf += data.replace(b"\r\n", b"\n")  # some servers end SSE lines with CRLF
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    payload = event.strip().removeprefix(b"data:").strip()
                    if not payload or payload == b"[DONE]":
                        continue
                    msg = json.loads(payload)
                    if "error" in msg:
                        err = msg["error"]
                        res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        return res
                    if msg.get("choices"):
                        if res.ttft_s is None:
                            res.ttft_s = now - sent
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    if msg.get("usage"):  # the last usage seen: the whole request's
                        res.output_tokens = int(msg["usage"]["completion_tokens"])
        res.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, ValueError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if res.ttft_s is None:
        res.error = "no token streamed"
    elif res.output_tokens != req.output_len:
        res.error = (f"usage says {res.output_tokens} output tokens, asked for exactly {req.output_len} "
                     "(max_tokens = min_tokens, ignore_eos)" if res.output_tokens else "no usage event in the stream")
    return res


def client_for(url: str, max_connections: int, timeout_s: float) -> httpx.AsyncClient:
    # An idle connection is dropped after 3 s, before the server's keep-alive timeout (uvicorn's 5 s, vLLM's too):
    # with httpx's default 5 s, a request could go out on a connection the server was closing (a ReadError).
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                          keepalive_expiry=3.0)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0))


async def run_load(ep: Endpoint, requests: Sequence[BenchRequest], *, rate: float, concurrency: int | None,
                   seed: int, timeout_s: float, on_done: Callable[[RequestResult], None] | None = None) -> LoadRun:
    """Send `requests` at Poisson arrival times of `rate` (inf: all at once), at most `concurrency` in flight
    (None: no cap); return every request's result (in request order) and the run's duration. Request i goes
    to the endpoint's i-th URL, round-robin (one URL: all to it)."""
    arrivals = poisson_arrivals(len(requests), rate, seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(client_for(url, concurrency or len(requests), timeout_s))
                   for url in ep.urls]
        t0, cpu0 = time.perf_counter(), time.process_time()

        async def one(i: int, req: BenchRequest, at: float) -> RequestResult:
            client = clients[i % len(clients)]
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                res = await send_one(client, ep, req, t0)
            else:
                async with gate:
                    res = await send_one(client, ep, req, t0)
            if on_done is not None:
                on_done(res)
            return res

        results = await asyncio.gather(*(one(i, r, at) for i, (r, at) in enumerate(zip(requests, arrivals, strict=True))))
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return LoadRun(results=list(results), duration_s=duration, client_cpu_s=cpu)
