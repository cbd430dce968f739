"""Every name shared.keys spells has the Redis type kvfleet keeps there (shared.keys.TYPES), which is what
shared.streams.key_types compares TYPE's answer with to name a key of another type."""

from __future__ import annotations

from shared import keys
from shared.streams.client import KeyOfAnotherType, wrong_type
from shared.streams.key_types import _of_another_type


def test_every_key_kvfleet_spells_has_its_redis_type():
    expected = {
        keys.req_stream("w0", 3): "stream", keys.req_any(1): "stream", keys.out_stream("r", 2): "stream",
        keys.inbox("gw-1-ab", 0): "stream", keys.CANCEL: "stream", keys.DEAD: "stream",
        keys.status("w0", 0): "string", keys.lease("r", 0): "string", keys.enqueued("r", 0): "string",
        keys.ROUND_ROBIN: "string", keys.cancelled("r"): "string", keys.job("r"): "string",
        keys.prefix_block("h2", "h1"): "string", keys.workers(5): "set", keys.SHARDS: "set",
        keys.reserved("w0", 0): "hash",
    }
    assert {name: keys.redis_type(name) for name in expected} == expected
    assert keys.redis_type("celery") is None and keys.redis_type("kvfleet:{s0}:unknown:x") is None


def test_only_a_type_other_than_kvfleets_is_named():
    names = [keys.workers(0), keys.req_any(0), keys.status("w0"), keys.DEAD, "not-ours"]
    found = _of_another_type(names, ["string", "stream", "none", RuntimeError("lost"), "hash"])
    assert [(f.key, f.found, f.expected) for f in found] == [(keys.workers(0), "string", "set")]
    message = str(found[0])
    assert "'kvfleet:{s0}:workers' holds a string where kvfleet keeps a set" in message
    assert "redis-cli DEL 'kvfleet:{s0}:workers'" in message
    assert wrong_type(found[0])


def test_wrongtype_is_recognised_alone_and_inside_a_script_or_pipeline_error():
    import redis

    assert wrong_type(redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert wrong_type(redis.ResponseError("Error running script (call to f_x): @user_script:36: WRONGTYPE Operation "
                                          "against a key holding the wrong kind of value"))
    assert wrong_type(redis.ResponseError("Command # 1 (SMEMBERS kvfleet:{s0}:workers) of pipeline caused error: "
                                          "WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert not wrong_type(redis.ResponseError("ERR value is not an integer or out of range"))
    assert not wrong_type(KeyError("WRONGTYPE Operation"))
    assert isinstance(KeyOfAnotherType("k", "string", "set"), redis.ResponseError)
