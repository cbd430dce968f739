"""shared.outage_log: a failure that repeats is said once per outage, then every `every_s`, and its end once."""

from __future__ import annotations

import logging

import pytest

from shared.outage_log import OutageLog, kind_of

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class ConnectionError_(Exception):  # noqa: N801 (a stand-in for redis-py's class)
    pass


class ResponseError(Exception):
    pass


@pytest.fixture
def outage(caplog):
    caplog.set_level(logging.INFO, logger="test.outage")
    clock = Clock()
    return OutageLog(logging.getLogger("test.outage"), "redis request read", every_s=30.0, clock=clock), clock


def messages(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records]


def test_a_hundred_failures_in_ten_seconds_are_one_line_and_the_end_another(outage, caplog):
    log, clock = outage
    for _ in range(100):
        log.failed(ConnectionError_("Error 111 connecting to 127.0.0.1:6379. Connection refused."))
        clock.t += 0.1
    log.ok()
    log.ok()  # no outage going on: nothing more
    assert messages(caplog) == [
        ("WARNING", "redis request read failed (Error 111 connecting to 127.0.0.1:6379. Connection refused.); "
                    "retrying (said again every 30 s while it fails)"),
        ("INFO", "redis request read works again after 10.0 s (100 failed tries)")]


def test_a_long_outage_is_said_again_every_every_s_with_how_long_and_how_many_tries(outage, caplog):
    log, clock = outage
    for _ in range(70):  # 70 s, a try a second
        log.failed(ConnectionError_("Connection refused."), "waiting for it")
        clock.t += 1.0
    said = messages(caplog)
    assert len(said) == 3, said
    assert said[1] == ("WARNING", "redis request read still failing after 30 s (31 tries; the last: Connection "
                                  "refused.); waiting for it")
    assert said[2][1].startswith("redis request read still failing after 60 s (61 tries")


def test_a_failure_of_another_kind_is_said_at_once(outage, caplog):
    log, clock = outage
    log.failed(ConnectionError_("Connection closed by server."))
    clock.t += 1
    log.failed(ConnectionError_("Error 111 connecting. Connection refused."))  # the same kind: quiet
    clock.t += 1
    log.failed(ResponseError("NOGROUP No such key 'kvfleet:{s0}:req:w1' or consumer group"))
    clock.t += 1
    log.failed(ResponseError("NOGROUP No such key"))
    assert [m for _, m in messages(caplog)] == [
        "redis request read failed (Connection closed by server.); retrying (said again every 30 s while it fails)",
        "redis request read failed (NOGROUP No such key 'kvfleet:{s0}:req:w1' or consumer group); retrying (said "
        "again every 30 s while it fails)"]


def test_a_door_that_sees_no_success_starts_a_new_outage_after_a_quiet_spell(outage, caplog):
    """A gateway answering 503s never calls ok(): a failure more than every_s after the last is a new outage."""
    log, clock = outage
    log.failed(ConnectionError_("refused"))
    clock.t += 5
    log.failed(ConnectionError_("refused"))
    clock.t += 31
    log.failed(ConnectionError_("refused"))
    said = [m for _, m in messages(caplog)]
    assert len(said) == 2 and all(m.startswith("redis request read failed (refused)") for m in said), said
    assert log.tries == 1 and log.since == clock.t


def test_kind_of_names_the_class_and_a_redis_error_code():
    assert kind_of(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")) == \
        "ResponseError:WRONGTYPE"
    assert kind_of(ResponseError("MISCONF Redis is configured to save RDB snapshots")) == "ResponseError:MISCONF"
    assert kind_of(ConnectionError_("Error 111 connecting")) == "ConnectionError_"
    assert kind_of(ConnectionError_("")) == "ConnectionError_"
