"""One real worker process (`kvfleet worker`, tiny random-weight model) and no gateway: the test writes to
its stream and reads its output the way a gateway does, through shared.streams, and checks what the worker
leaves in Redis: every chunk once and in order, the entry acked in the same MULTI as the final chunk, the
reservation gone once the status counts the request, cancels honoured mid-stream, the status removed on exit.
"""

from __future__ import annotations

import signal

import pytest
from fleet_harness import Fleet

from shared import keys, streams
from shared.messages import GenerationRequest, WorkerStatus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

WID = "w-loop"


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("worker-loop")) as f:
        f.start_worker(WID, "--num-kv-blocks", "64", "--max-num-seqs", "8")
        r = streams.connect(f.redis.url)
        f.wait_for(lambda: r.get(keys.status(WID)) or f.workers[WID].poll() is not None, timeout_s=180,
                   what="the worker's first status")
        assert f.workers[WID].poll() is None, f.tail()
        yield f


@pytest.fixture
def r(fleet):
    client = streams.connect(fleet.redis.url)
    yield client
    client.close()


def request(rid: str, max_tokens: int, **kw) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest(request_id=rid, prompt_token_ids=[1, 415, 2936, 9060, 285],
                             sampling_params=params.to_dict(), **kw)


def assert_acked(r, entry_id: str) -> None:
    stream = keys.req_stream(WID)
    assert r.xrange(stream, entry_id, entry_id) == [], "the entry is deleted"
    assert r.xpending(stream, keys.GROUP)["pending"] == 0, "and acked"


def test_a_request_in_numbered_chunks_out_then_the_ack(r, fleet):
    entry = streams.enqueue(r, request("loop-1", max_tokens=12, kv_blocks=1), WID)
    chunks = list(streams.iter_output(r, "loop-1", timeout_s=60))
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(len(c.token_ids) for c in chunks) == 12
    last = chunks[-1]
    assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == ("length", 5, 12)
    assert {c.worker_id for c in chunks} == {WID}
    assert_acked(r, entry)  # the final chunk and the ack went in one MULTI: both are there once it is read
    fleet.wait_for(lambda: not r.hexists(keys.reserved(WID), "loop-1"), timeout_s=5,
                   what="the reservation to go with the status that counts the request")
    fleet.wait_for(lambda: WorkerStatus.model_validate_json(r.get(keys.status(WID))).num_finished >= 1,
                   timeout_s=5, what="the status to count the finished request")


def test_requests_it_never_runs_lose_their_reservation_too(r, fleet):
    """A cancelled one (closed by the intake) and an invalid one (failed by the engine): neither may keep its
    reservation, which would count against the worker's room and its queue bound until the hash expired."""
    streams.cancel(r, "never-1")
    streams.enqueue(r, request("never-1", max_tokens=4, kv_blocks=2), WID)
    streams.enqueue(r, request("never-2", max_tokens=10**6, kv_blocks=2), WID)  # past the context window
    assert [c.finish_reason for c in streams.iter_output(r, "never-1", timeout_s=60)][-1] == "abort"
    assert list(streams.iter_output(r, "never-2", timeout_s=60))[-1].error is not None
    fleet.wait_for(lambda: not r.hexists(keys.reserved(WID), "never-1") and not r.hexists(keys.reserved(WID), "never-2"),
                   timeout_s=5, what="the reservations to go with the worker's next status")


def test_a_cancel_mid_stream_ends_the_request(r, fleet):
    entry = streams.enqueue(r, request("loop-cancel", max_tokens=800), WID)
    output = streams.iter_output(r, "loop-cancel", timeout_s=60)
    first = next(output)
    assert not first.final
    streams.cancel(r, "loop-cancel")
    rest = list(output)
    assert rest[-1].final and rest[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in [first, *rest]) < 800
    assert [c.seq for c in [first, *rest]] == list(range(1 + len(rest)))
    assert_acked(r, entry)


def test_sigterm_when_idle_exits_cleanly_and_removes_the_status(r, fleet):
    fleet.signal_worker(WID, signal.SIGTERM)
    assert fleet.workers[WID].wait(30) == 0, fleet.tail()
    assert r.get(keys.status(WID)) is None
