"""services.bench.load_gen on its own: one streamed request read and timed from a canned SSE body (httpx's
MockTransport), errors recorded rather than raised, and the sweep's shifted prompts."""

import asyncio
import json

import httpx
import pytest

from services.bench.load_gen import Endpoint, completion_body, send_one, shifted
from services.bench.workload import BenchRequest

pytestmark = pytest.mark.unit
REQ = BenchRequest(id=7, prompt_token_ids=[5, 6, 7], output_len=3)


def _sse(*events: dict, crlf: bool = False) -> bytes:
    sep = "\r\n\r\n" if crlf else "\n\n"
    return "".join(f"data: {json.dumps(e)}{sep}" for e in events).encode() + f"data: [DONE]{sep}".encode()


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": None}


USAGE = {"id": "c", "object": "text_completion", "choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 3}}


def _send(handler, ep: Endpoint = Endpoint("http://x", "m", "key")):
    async def main():
        async with httpx.AsyncClient(base_url=ep.url, transport=httpx.MockTransport(handler)) as client:
            return await send_one(client, ep, REQ, 0.0)

    return asyncio.run(main())


@pytest.mark.parametrize("crlf", [False, True])
def test_one_streamed_request_is_timed_and_counted(crlf):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, content=_sse(_chunk("a"), _chunk("b"), _chunk("c", "length"), USAGE, crlf=crlf))

    res = _send(handler)
    assert res.ok, res.error
    assert seen["body"] == completion_body("m", REQ)
    assert seen["body"]["prompt"] == [5, 6, 7] and seen["body"]["max_tokens"] == seen["body"]["min_tokens"] == 3
    assert seen["body"]["ignore_eos"] and seen["body"]["stream_options"] == {"include_usage": True}
    assert seen["auth"] == "Bearer key"
    assert res.output_tokens == 3 and len(res.itl_s) == 2
    assert 0 <= res.ttft_s <= res.e2e_s and res.tpot_s == pytest.approx((res.e2e_s - res.ttft_s) / 2)


def test_failures_are_recorded_not_raised():
    res = _send(lambda r: httpx.Response(400, json={"error": {"message": "max_tokens too large"}}))
    assert res.error == "HTTP 400: max_tokens too large" and not res.ok
    res = _send(lambda r: httpx.Response(200, content=_sse(_chunk("a"), {"error": {"message": "worker died"}})))
    assert res.error == "stream error: worker died"
    res = _send(lambda r: httpx.Response(200, content=_sse(_chunk("a"), _chunk("b", "length"))))
    assert res.error == "no usage event in the stream"
    res = _send(lambda r: httpx.Response(200, content=_sse(_chunk("a"), {**USAGE, "usage": {"completion_tokens": 1}})))
    assert "usage says 1 output tokens, asked for exactly 3" in res.error

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    assert _send(refuse).error.startswith("ConnectError")


def test_shifted_keeps_lengths_and_shared_prefixes():
    reqs = [BenchRequest(0, [1, 2, 3, 40], 5), BenchRequest(1, [1, 2, 3, 9, 9], 6)]
    assert shifted(reqs, 0, 50) == reqs and shifted(reqs, 100, 50) == reqs
    out = shifted(reqs, 11, 50)
    assert [r.prompt_token_ids for r in out] == [[12, 13, 14, 1], [12, 13, 14, 20, 20]]
    assert [(r.id, r.output_len) for r in out] == [(0, 5), (1, 6)]


def test_a_sampled_endpoint_sends_its_parameters_in_every_request():
    body = completion_body("m", REQ, {"temperature": 0.8, "top_p": 0.95, "top_k": 0})
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.8, 0.95, 0)
    assert body["ignore_eos"] and body["max_tokens"] == body["min_tokens"] == REQ.output_len
    assert completion_body("m", REQ)["temperature"] == 0.0  # greedy by default
