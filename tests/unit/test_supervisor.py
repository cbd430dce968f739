"""services/supervisor.py: when a child of `kvfleet up` starts again (backoff doubling to a cap, back to the
first delay after a healthy minute), when it stays down (crash loop), and how its end is told."""

from __future__ import annotations

import signal

import pytest

from services.supervisor import REDIS_POLICY, ChildRestarts, RestartPolicy, exit_reason

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def crash_and_restart(child: ChildRestarts, clock: FakeClock, ran_s: float) -> float | None:
    """It runs `ran_s`, exits, and (unless it stays down) starts again exactly when due; returns the delay."""
    clock.now += ran_s
    delay = child.exited()
    if delay is not None:
        assert not child.due()
        clock.now += delay
        assert child.due()
        child.started()
    return delay


def test_backoff_doubles_up_to_the_cap():
    clock = FakeClock()
    child = ChildRestarts(RestartPolicy(max_restarts=100), clock)
    child.started()
    delays = [crash_and_restart(child, clock, ran_s=5.0) for _ in range(8)]
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert child.restarts == 8 and child.exits == 8 and not child.down


def test_a_healthy_minute_resets_the_backoff():
    clock = FakeClock()
    child = ChildRestarts(RestartPolicy(), clock)
    child.started()
    assert [crash_and_restart(child, clock, ran_s=1.0) for _ in range(3)] == [1, 2, 4]
    assert crash_and_restart(child, clock, ran_s=59.0) == 8  # not yet a minute up
    assert crash_and_restart(child, clock, ran_s=60.0) == 1  # a minute up: it starts over
    assert crash_and_restart(child, clock, ran_s=1.0) == 2


def test_crash_loop_stays_down_after_five_restarts_in_a_minute():
    clock = FakeClock()
    child = ChildRestarts(RestartPolicy(), clock)  # 5 restarts within 60 s
    child.started()
    assert [crash_and_restart(child, clock, ran_s=0.5) for _ in range(5)] == [1, 2, 4, 8, 16]
    assert child.recent_restarts() == 5  # all within 33.5 s
    assert crash_and_restart(child, clock, ran_s=0.5) is None
    assert child.down and child.exits == 6 and child.restarts == 5
    assert child.restart_at is None and not child.due()
    clock.now += 3600
    assert not child.due()  # it stays down


def test_restarts_spread_over_more_than_the_window_are_no_crash_loop():
    clock = FakeClock()
    child = ChildRestarts(RestartPolicy(), clock)
    child.started()
    # each run lasts 20 s: the 1+2+4+8+16 s of backoff and the runs take more than a minute for 5 restarts
    delays = [crash_and_restart(child, clock, ran_s=20.0) for _ in range(10)]
    assert None not in delays and delays[-1] == 30 and not child.down
    assert child.recent_restarts() < 5


def test_policy_for_a_restart_at_once_and_only_once_a_minute():
    clock = FakeClock()
    redis = ChildRestarts(RestartPolicy(first_delay_s=0.0, max_restarts=1), clock)
    clock.now += 10
    assert redis.exited() == 0.0 and redis.due()
    redis.started()
    clock.now += 30
    assert redis.exited() is None  # died again within a minute of its restart
    again = ChildRestarts(RestartPolicy(first_delay_s=0.0, max_restarts=1), clock)
    assert again.exited() == 0.0
    again.started()
    clock.now += 61
    assert again.exited() == 0.0  # a minute later it may be restarted once more


def test_the_private_redis_restarts_fast_and_stops_the_fleet_past_five_a_minute():
    clock = FakeClock()
    redis = ChildRestarts(REDIS_POLICY, clock)
    delays = []
    for _ in range(5):
        clock.now += 1
        delays.append(redis.exited())
        clock.now += delays[-1]
        assert redis.due()
        redis.started()
    assert delays == [0.5, 1.0, 2.0, 2.0, 2.0]
    clock.now += 1
    assert redis.exited() is None and redis.down  # its AOF or its machine is the trouble: the fleet stops


def test_exit_reason_names_the_signal_or_the_code_and_the_stderr_tail():
    assert exit_reason(-signal.SIGKILL, ["noise\n"]) == "killed by SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_reason(-200) == "killed by signal 200"
    assert exit_reason(0, ["INFO stopped\n"]) == "exited with code 0"
    reason = exit_reason(1, ["Traceback (most recent call last):\n", "\n", "RuntimeError: Overflow\n"])
    assert reason == ("exited with code 1; the end of its stderr:\n    Traceback (most recent call last):\n"
                      "    RuntimeError: Overflow")
    assert exit_reason(3) == "exited with code 3"
