"""The worker's send state: the engine's delta outputs -> numbered chunks; a takeover resumes the chunk
numbers and the tokens already sent, so a reader sees nothing twice and nothing skipped."""

from __future__ import annotations

import pytest

from gpu_worker.engine.outputs import CompletionOutput, RequestOutput
from gpu_worker.serve.request_tracker import Job, RequestTracker
from shared.messages import GenerationRequest, OutputChunk
from shared.sampling_params import SamplingParams
from shared.settings import Settings, redacted_url
from shared.streams import ChunkDeduper

pytestmark = pytest.mark.unit


def job(n: int = 1, max_tokens: int = 8) -> Job:
    req = GenerationRequest(request_id="r1", prompt_token_ids=list(range(20)),
                            sampling_params=SamplingParams(n=n, max_tokens=max_tokens).to_dict())
    return Job(request=req, stream="kvfleet:req:w", entry_id="1-0")


def out(*comps: tuple[str, list[int], str | None], finished: bool = False) -> RequestOutput:
    return RequestOutput("r1", None, list(range(20)), [
        CompletionOutput(index=i, text=t, token_ids=ids, logprobs=None, finish_reason=fr)
        for i, (t, ids, fr) in enumerate(comps)], finished)


def test_delta_outputs_become_numbered_chunks():
    tr = RequestTracker("w")
    tr.add(job())
    a = tr.chunks_for(out(("Hel", [1], None)))
    b = tr.chunks_for(out(("lo", [2], None)))
    held = tr.chunks_for(out(("", [], None)))  # nothing new (text held back, say): no chunk, no number
    c = tr.chunks_for(out(("!", [3], "stop"), finished=True))
    chunks = a + b + held + c
    assert [(x.seq, x.text, x.token_ids) for x in chunks] == [(0, "Hel", [1]), (1, "lo", [2]), (2, "!", [3])]
    assert c[-1].final and c[-1].finish_reason == "stop"
    assert (c[-1].usage.prompt_tokens, c[-1].usage.completion_tokens) == (20, 3)
    assert tr.chunks_for(out(("", [], "stop"), finished=True)) == [
        OutputChunk(request_id="r1", seq=3, final=True, usage=c[-1].usage, worker_id="w", delivery=1)]
    assert {x.owner_token() for x in chunks} == {(0, 1)}, "each chunk carries its writer's owner token"


def test_a_choice_that_finished_is_not_sent_again():
    tr = RequestTracker("w")
    tr.add(job(n=2))
    a = tr.chunks_for(out(("a", [1], "stop"), ("b", [5], None)))
    # the engine repeats each choice's finish reason in every output of its request
    b = tr.chunks_for(out(("", [], "stop"), (" c", [6], "length"), finished=True))
    assert [(x.index, x.seq, x.text, x.finish_reason) for x in a + b] == [
        (0, 0, "a", "stop"), (1, 1, "b", None), (1, 2, " c", "length")]
    assert b[-1].final and b[-1].usage.completion_tokens == 3


def test_a_takeover_continues_where_the_dead_worker_stopped():
    written = [OutputChunk(request_id="r1", seq=0, token_ids=[1], text="Hel"),
               OutputChunk(request_id="r1", seq=1, token_ids=[2], text="lo"),
               OutputChunk(request_id="r1", seq=1, token_ids=[2], text="lo")]  # written twice: counted once
    j = job().resume_from(written)
    assert j.resume_token_ids() == [[1, 2]] and j.next_seq == 2 and not j.done
    tr = RequestTracker("w2")
    tr.add(j)
    # the new engine recomputes the resumed tokens but sends only what comes after them
    chunks = tr.chunks_for(out((" wor", [7], None)))
    assert [(x.seq, x.text, x.token_ids) for x in chunks] == [(2, " wor", [7])]
    dedup = ChunkDeduper()
    assert [x.seq for x in written + chunks if dedup.accept(x)] == [0, 1, 2]


def test_a_finished_choice_is_not_sent_again_after_a_takeover():
    written = [OutputChunk(request_id="r1", seq=0, index=0, token_ids=[1], text="a", finish_reason="stop"),
               OutputChunk(request_id="r1", seq=1, index=1, token_ids=[5], text="b")]
    j = job(n=2).resume_from(written)
    tr = RequestTracker("w2")
    tr.add(j)
    chunks = tr.chunks_for(out((" z", [9], None), (" c", [6], "length"), finished=True))
    assert [(x.index, x.seq, x.text) for x in chunks] == [(1, 2, " c")] and chunks[0].final
    assert chunks[0].usage.completion_tokens == 3


def test_a_request_whose_final_chunk_was_written_only_needs_its_ack():
    j = job().resume_from([OutputChunk(request_id="r1", seq=0, token_ids=[1], final=True)])
    assert j.done


def test_promised_blocks_count_what_requests_will_still_claim():
    tr = RequestTracker("w")
    tr.add(job(max_tokens=28))  # 20 prompt + 28 output tokens = 3 blocks of 16
    assert tr.promised_blocks(16, 512) == 3
    tr.chunks_for(out(("x", [1], None)))  # started: 21 tokens hold 2 blocks
    assert tr.promised_blocks(16, 512) == 1
    capped = RequestTracker("w")
    capped.add(job(max_tokens=28))
    capped.chunks_for(out(("x", [1], None)))
    assert capped.promised_blocks(16, 4) == 0  # the router counts at most 4 output tokens: 2 blocks, held


def test_settings_come_from_the_environment_and_flags():
    env = {"KVFLEET_REDIS_URL": "rediss://u:secret@h:6380/1", "KVFLEET_API_KEYS": "a, b",
           "KVFLEET_QUEUE_BOUND": "7", "KVFLEET_QUEUE_WHEN_NO_WORKERS": "true", "KVFLEET_STATUS_TTL_S": "2.5"}
    s = Settings.from_env(env, queue_bound=None, routing="prefix")
    assert (s.redis_url, s.api_keys, s.queue_bound, s.queue_when_no_workers, s.status_ttl_s, s.routing) == (
        "rediss://u:secret@h:6380/1", ("a", "b"), 7, True, 2.5, "prefix")
    assert "secret" not in repr(s) and "'a'" not in repr(s)
    assert redacted_url(s.redis_url) == "rediss://u:***@h:6380/1"
    assert redacted_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError, match="KVFLEET_QUEUE_BOUND"):
        Settings.from_env({"KVFLEET_QUEUE_BOUND": "many"})


def test_redis_urls_with_tls_and_passwords_build_the_right_clients():
    from shared.streams import connect, connect_async

    for make in (connect, connect_async):
        pool = make("rediss://:p%40ss@redis.example:6380/2").connection_pool
        assert "SSL" in pool.connection_class.__name__
        assert pool.connection_kwargs["password"] == "p@ss" and pool.connection_kwargs["db"] == 2
        assert "SSL" not in make("redis://127.0.0.1:6379/0").connection_pool.connection_class.__name__
