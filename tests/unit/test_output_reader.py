"""shared.streams.output's reader against a scripted Redis: a dropped connection pauses it and it goes on after
the last entry read; past the grace it raises RedisAway; a restart that lost the request (its output stream
or, before any output, its request entry gone) or chunks of it (a sequence gap) raises OutputLost."""

from __future__ import annotations

import pytest
import redis

from shared import keys, streams
from shared.messages import OutputChunk

RID = "r1"


def entry(seq: int, final: bool = False) -> tuple[str, dict[str, str]]:
    chunk = OutputChunk(request_id=RID, seq=seq, text=f"t{seq}", token_ids=[seq], final=final)
    return f"{seq + 1}-0", {keys.FIELD: chunk.model_dump_json()}


class ScriptedRedis:
    """XREAD answers from `script`, in order: a list of entries, or an exception to raise. EXISTS and
    XRANGE answer from `output_exists` / `entry_exists`."""

    def __init__(self, script: list, *, output_exists: bool = True, entry_exists: bool = True):
        self.script, self.output_exists, self.entry_exists = list(script), output_exists, entry_exists
        self.read_from: list[str] = []

    def execute_command(self, command: str, *args):
        assert command == "XREAD" and args[-3] == "STREAMS", args  # COUNT n BLOCK ms STREAMS key id
        self.read_from.append(args[-1])
        step = self.script.pop(0) if self.script else []
        if isinstance(step, Exception):
            raise step
        return [[keys.out_stream(RID), step]] if step else []

    def exists(self, _key: str) -> int:
        return int(self.output_exists)

    def xrange(self, *_args):
        return [("1-0", {})] if self.entry_exists else []

    def pexpire(self, *_args) -> None:
        pass


def read(r: ScriptedRedis, **kw) -> list[int]:
    return [c.seq for c in streams.iter_output(r, RID, 0, timeout_s=30, block_ms=1, **kw)]


def test_a_dropped_connection_pauses_the_reader_and_it_goes_on_after_the_last_entry():
    down = redis.ConnectionError("Connection refused")
    r = ScriptedRedis([[entry(0), entry(1)], down, down, [], [entry(2, final=True)]])
    assert read(r, grace_s=5) == [0, 1, 2]
    assert r.read_from == ["0-0", "2-0", "2-0", "2-0", "2-0"]


def test_past_the_grace_the_reader_raises_redis_away():
    r = ScriptedRedis([[entry(0)]] + [redis.ConnectionError("Connection refused")] * 100)
    with pytest.raises(streams.RedisAway, match=r"more than 0.3s \(redis_grace_s\)") as e:
        read(r, grace_s=0.3)
    assert isinstance(e.value, streams.CONNECTION_ERRORS)  # Celery's autoretry and the client catch these


def test_output_gone_after_a_reconnect_means_redis_lost_the_request():
    r = ScriptedRedis([[entry(0)], redis.ConnectionError("gone"), []], output_exists=False)
    with pytest.raises(streams.OutputLost, match="Redis lost request r1"):
        read(r, grace_s=5)


def test_before_any_output_the_request_entry_tells_whether_redis_kept_it():
    kept = ScriptedRedis([redis.ConnectionError("gone"), [], [entry(0, final=True)]], output_exists=False)
    assert read(kept, grace_s=5, entry=("kvfleet:req:w0", "1-0")) == [0]
    lost = ScriptedRedis([redis.ConnectionError("gone"), []], output_exists=False, entry_exists=False)
    with pytest.raises(streams.OutputLost):
        read(lost, grace_s=5, entry=("kvfleet:req:w0", "1-0"))


def test_a_sequence_gap_means_chunks_were_lost():
    r = ScriptedRedis([[entry(0)], [entry(3, final=True)]])
    with pytest.raises(streams.OutputLost, match="chunks 1..2 of request r1"):
        read(r, grace_s=5)


def test_rewritten_chunks_of_a_resumed_request_are_given_once():
    r = ScriptedRedis([[entry(0), entry(1)], [entry(1), entry(2, final=True)]])
    assert read(r, grace_s=5) == [0, 1, 2]


def test_a_stream_that_vanished_without_a_dropped_connection_is_noticed(monkeypatch):
    """A FLUSHALL drops no connection: a reader that got output, then none for a while, checks its stream."""
    from shared.streams import output

    monkeypatch.setattr(output, "SILENCE_CHECK_S", 0.0)
    flushed = ScriptedRedis([[entry(0)], [], []], output_exists=False)
    with pytest.raises(streams.OutputLost, match="Redis lost request r1"):
        read(flushed, grace_s=5)
    waiting = ScriptedRedis([[], [], [entry(0, final=True)]], output_exists=False, entry_exists=False)
    assert read(waiting, grace_s=5) == [0]  # no output yet, no outage: a queued request is not misjudged
