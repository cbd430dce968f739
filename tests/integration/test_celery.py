"""Celery tasks into the fleet: a real Redis (with a password), a real fleet worker on the tiny model, real
`celery -A services.celery_app worker` processes. One fleet and one main Celery worker for the module.

The main Celery worker runs with KVFLEET_QUEUE_BOUND=0: a request that no worker can take now is answered 429
at once (nothing waits in the shared queue), which the 429 test uses."""

from __future__ import annotations

import json
import socket

import pytest
from celery import Celery
from celery_harness import CeleryWorker
from fleet_harness import Fleet

from services import job_record
from services.call_errors import InvalidRequest
from services.celery_app import app, chat, configure, generate
from shared import keys, streams
from shared.messages import WorkerStatus
from shared.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("celery"), env={"KVFLEET_QUEUE_BOUND": "0"}) as f:
        f.start_worker("w0", "--num-kv-blocks", "512", "--max-num-seqs", "64")
        main = CeleryWorker(f, "main").start()
        try:
            r = streams.connect(f.redis.url)
            f.wait_for(lambda: r.get(keys.status("w0")), 180, "fleet worker w0")
            main.wait_ready()
            configure(app, Settings(redis_url=f.redis.url))
            f.main_celery = main
            yield f
        finally:
            main.stop()


@pytest.fixture
def r(fleet):
    client = streams.connect(fleet.redis.url)
    yield client
    client.close()


def output_chunks(r, request_id):
    return streams.read_all_chunks(r, request_id)


def test_generate_delay_get_returns_the_text(fleet, r):
    res = generate.delay("The capital of France is", max_tokens=8, temperature=0, ignore_eos=True)
    out = res.get(timeout=120)
    json.dumps(out)  # a plain JSON-serialisable dict
    assert out["id"] == res.id and out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert out["usage"]["completion_tokens"] == 8
    # the task id is the fleet request id: its output stream holds exactly this text
    assert "".join(c.text for c in output_chunks(r, res.id)) == choice["text"]


def test_generate_with_a_batch_of_prompts(fleet, r):
    """A list of prompts: one fleet request per prompt (`{task id}-{i}`), one body (choices prompt-major)."""
    res = generate.delay(["Hello", "Goodbye"], max_tokens=3, n=2, ignore_eos=True)
    out = res.get(timeout=120)
    assert out["id"] == res.id and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["completion_tokens"] == 12
    for i in range(2):
        chunks = output_chunks(r, f"{res.id}-{i}")
        assert {c.index for c in chunks if c.token_ids} == {0, 1}
        assert sum(len(c.token_ids) for c in chunks) == 6


def test_chat_task(fleet):
    res = chat.delay([{"role": "user", "content": "Say hello"}], max_tokens=5, temperature=0)
    out = res.get(timeout=120)
    assert out["id"] == res.id and out["object"] == "chat.completion"
    assert isinstance(out["choices"][0]["message"]["content"], str)
    assert 1 <= out["usage"]["completion_tokens"] <= 5 and out["usage"]["prompt_tokens"] > 5


def test_a_backend_without_kvfleet_calls_the_tasks_by_name(fleet):
    """A service with its own Celery app (it does not import kvfleet) on the same broker."""
    backend = Celery("some-backend", broker=fleet.redis.url, backend=fleet.redis.url)
    res = backend.send_task("kvfleet.chat", kwargs={"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 3, "ignore_eos": True})
    assert res.get(timeout=120)["usage"]["completion_tokens"] == 3
    with pytest.raises(Exception, match="temperature") as exc:
        backend.send_task("kvfleet.generate", args=["Hi"], kwargs={"temperature": -1}).get(timeout=60)
    assert type(exc.value).__name__ == "InvalidRequest"


def test_fifty_tasks_at_once_all_complete(fleet):
    results = [generate.delay(f"Request number {i} says", max_tokens=4, ignore_eos=True, seed=i) for i in range(50)]
    outs = [res.get(timeout=300) for res in results]
    assert [o["id"] for o in outs] == [res.id for res in results]
    assert all(o["usage"]["completion_tokens"] == 4 and o["choices"][0]["text"] for o in outs)


@pytest.mark.parametrize(("params", "field", "words"), [
    ({"temperature": 5}, "temperature", "less than or equal to 2"),
    ({"max_tokenz": 5}, "max_tokenz", "unknown parameter"),
    ({"max_tokens": 5000}, "prompt", "maximum context length is 1024"),
    ({"model": "no-such-model"}, "model", "does not exist"),
])
def test_bad_request_fails_at_once_naming_the_field(fleet, params, field, words):
    res = generate.delay("Hello", **params)
    with pytest.raises(InvalidRequest) as exc:
        res.get(timeout=60)
    assert exc.value.param == field and words in str(exc.value), str(exc.value)
    assert res.state == "FAILURE"
    assert f"Task kvfleet.generate[{res.id}] retry" not in fleet.main_celery.log()


def test_bad_chat_request_names_the_field(fleet):
    with pytest.raises(InvalidRequest) as exc:
        chat.delay([], max_tokens=4).get(timeout=60)
    assert exc.value.param == "messages"


def test_full_fleet_is_retried_until_capacity_frees(fleet, r):
    # Another gateway has reserved every block of the only worker: no room, and the shared queue's bound is 0.
    # (All of them: a reservation over the worker's whole cache is no gateway's, and counts nothing.)
    total = WorkerStatus.model_validate_json(r.get(keys.status("w0"))).total_blocks
    r.hset(keys.reserved("w0"), "someone-else", total)
    try:
        res = generate.delay("Patience is", max_tokens=4, ignore_eos=True)
        fleet.wait_for(lambda: res.state == "RETRY", 60, "the task to be retried after a 429")
        assert "the fleet is full" in str(res.info)
    finally:
        r.hdel(keys.reserved("w0"), "someone-else")
    out = res.get(timeout=180)
    assert out["usage"]["completion_tokens"] == 4
    assert f"Task kvfleet.generate[{res.id}] retry" in fleet.main_celery.log()


def test_killed_celery_worker_redelivers_and_generates_once(fleet, r):
    """SIGKILL the Celery worker in the middle of a task: Celery redelivers the task (acks_late) and the second
    delivery attaches to the first one's generation, so the fleet generates it exactly once."""
    doomed = CeleryWorker(fleet, "doomed", queues="kvfleet-kill", pool="solo", concurrency=1).start()
    # The rescuer starts on another queue (so the task goes to the doomed worker) and, with a 2 s visibility
    # timeout, puts tasks left unacked by a dead worker back on their queue.
    rescuer = CeleryWorker(fleet, "rescuer", queues="kvfleet-idle", pool="solo", concurrency=1,
                           env={"KVFLEET_CELERY_VISIBILITY_TIMEOUT_S": "2"}).start()
    try:
        doomed.wait_ready()
        rescuer.wait_ready()
        res = generate.apply_async(kwargs=dict(prompt="Once upon a time", max_tokens=200, ignore_eos=True,
                                               temperature=0), queue="kvfleet-kill")
        fleet.wait_for(lambda: r.xlen(keys.out_stream(res.id)) > 0, 120, "the first output chunk")
        doomed.kill()
        assert not any(c.final for c in output_chunks(r, res.id)), "finished before the kill: use more tokens"
        app.control.add_consumer("kvfleet-kill", destination=[f"rescuer@{socket.gethostname()}"], reply=True)
        out = res.get(timeout=300)
    finally:
        doomed.kill() if doomed.proc.poll() is None else None
        rescuer.stop()
    assert f"Task kvfleet.generate[{res.id}] received" in rescuer.log()
    assert out["id"] == res.id and out["usage"]["completion_tokens"] == 200
    chunks = output_chunks(r, res.id)
    assert [c.seq for c in chunks] == list(range(len(chunks))), "a chunk was generated twice"
    assert sum(c.final for c in chunks) == 1
    assert sum(len(c.token_ids) for c in chunks) == 200
    assert "".join(c.text for c in chunks) == out["choices"][0]["text"]
    record = job_record.Record.loads(r.get(keys.job(res.id)))
    assert record.state == "done" and record.result == out


def test_result_survives_in_the_job_record(fleet, r):
    """A task delivered again after it finished returns the stored result without asking the fleet again."""
    res = generate.delay("Remember me", max_tokens=3, ignore_eos=True)
    first = res.get(timeout=120)
    r.delete(keys.out_stream(res.id))  # its output stream has expired meanwhile
    done = f"Task kvfleet.generate[{res.id}] succeeded"
    generate.apply_async(args=["Remember me"], kwargs={"max_tokens": 3, "ignore_eos": True}, task_id=res.id)
    fleet.wait_for(lambda: fleet.main_celery.log().count(done) == 2, 120, "the second delivery to finish")
    assert app.AsyncResult(res.id).get(timeout=10) == first
    assert not r.exists(keys.out_stream(res.id))  # nothing was generated again
