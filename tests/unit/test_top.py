"""services/top.py: the frame it draws, for `kvfleet top` and `kvfleet status` (free-block bars, reserved blocks,
tokens/s from two reads, TTFT, restarts, stream lag)."""

from __future__ import annotations

import pytest

from services.top import Sample, bar, render, tokens_per_s

pytestmark = pytest.mark.unit


def worker(wid: str, free: int, total: int, tokens: int, **kw) -> dict:
    return {"worker_id": wid, "model": "tiny", "free_blocks": free, "total_blocks": total, "running": 2,
            "waiting": 1, "num_preemptions": 0, "heartbeat_age_s": 0.3, "draining": False,
            "generation_tokens": tokens, "reserved_blocks": 0} | kw


def snap(*workers, streams=None) -> dict:
    return {"workers": list(workers), "dead_workers": [], "dead_letters": 0,
            "streams": streams or {"kvfleet:req:any": {"length": 5, "pending": 2}}}


def test_bar_shows_used_blocks():
    assert bar(10, 10, width=10) == "[" + "." * 10 + "]"
    assert bar(0, 10, width=10) == "[" + "#" * 10 + "]"
    assert bar(25, 100, width=4) == "[###.]"
    assert bar(0, 0, width=3) == "[...]"


def test_tokens_per_second_from_two_reads():
    prev = Sample(snap(worker("w1", 5, 10, tokens=100)), at=10.0)
    now = Sample(snap(worker("w1", 5, 10, tokens=150)), at=12.0)
    assert tokens_per_s(now, prev, "w1") == 25.0
    assert tokens_per_s(now, None, "w1") is None
    assert tokens_per_s(Sample(snap(worker("w2", 1, 2, 9)), 13.0), prev, "w2") is None  # new worker


def test_frame_lists_workers_streams_and_ttft():
    prev = Sample(snap(worker("w1", 5, 10, tokens=0)), at=0.0)
    now = Sample(snap(worker("w1", 4, 16, tokens=30, ttft_p50_s=0.012, ttft_p95_s=0.05, ttft_p99_s=0.2,
                             reserved_blocks=3),
                      worker("w0", 16, 16, tokens=0, draining=True)), at=1.0)
    lines = render(now, prev)
    text = "\n".join(lines)
    (w1,) = [line for line in lines if line.startswith("w1")]
    assert "[###############.....]" in w1 and "4/16" in w1 and "30.0" in w1 and "12/50/200" in w1
    assert w1.split()[1:5] == ["tiny", "[###############.....]", "4/16", "3"]  # model, bar, blocks, reserved
    (w0,) = [line for line in lines if line.startswith("w0")]
    assert "draining" in w0 and "-/-/-" in w0
    (stream,) = [line for line in lines if line.startswith("kvfleet:req:any")]
    assert stream.split()[1:] == ["5", "2", "3"]  # length, pending, lag
    assert "30.0 tokens/s" in text
    assert all(len(line) <= 60 for line in render(now, prev, width=60))
    assert "(no live worker)" in render(Sample(snap(), 1.0), None)


def test_frame_shows_restarts_per_worker():
    lines = render(Sample(snap(worker("w0", 8, 16, 0, restarts=3, draining=True), worker("w1", 8, 16, 0)), 1.0), None)
    at = lines[0].index("RESTARTS")
    column = [line[at:at + len("RESTARTS")] for line in lines[1:3]]
    assert column == ["       3", "       0"]  # right-aligned under the header; a status without the field: 0
    assert lines[1].endswith("s draining")


def test_frame_marks_simulated_workers_with_their_profile():
    lines = render(Sample(snap(worker("w0", 8, 16, 0, simulated="smollm2-cpu"), worker("w1", 8, 16, 0)), 1.0), None,
                   width=200)
    assert lines[1].endswith("s simulated:smollm2-cpu")
    assert "simulated" not in lines[2]


def test_redis_memory_is_shown_and_a_full_redis_said_so():
    from services.top import redis_memory

    mib = 1024 * 1024
    assert redis_memory(None) == ""  # a cluster: a figure per master, not shown
    assert redis_memory({"used_memory": 3 * mib, "maxmemory": 0, "maxmemory_policy": "noeviction"}) == " | redis 3.0 MiB"
    assert redis_memory({"used_memory": mib, "maxmemory": 64 * mib, "maxmemory_policy": "noeviction"}) == (
        " | redis 1.0 of 64.0 MiB")
    full = redis_memory({"used_memory": 65 * mib, "maxmemory": 64 * mib, "maxmemory_policy": "noeviction"})
    assert full == " | redis 65.0 of 64.0 MiB: FULL, it refuses writes (raise its maxmemory)"
    assert "FULL" not in redis_memory({"used_memory": 65 * mib, "maxmemory": 64 * mib,
                                       "maxmemory_policy": "allkeys-lru"})  # it evicts instead


def test_a_redis_that_cannot_persist_is_said_so_on_a_line_of_its_own():
    redis = {"used_memory": 3 * 1024 * 1024, "maxmemory": 0, "maxmemory_policy": "noeviction",
             "persistence_error": "its last RDB snapshot failed: with save points, it refuses writes"}
    frame = render(Sample(snap(worker("w1", 5, 10, tokens=0)) | {"redis": redis}, at=0.0), None)
    assert frame[-1] == ("redis CANNOT PERSIST: its last RDB snapshot failed: with save points, it refuses writes (free "
                         "space on its data volume)") and frame[-2].endswith("| redis 3.0 MiB")
