"""gpu_worker.serve.watchdog alone: a main loop that stops coming round for stall_s makes the watchdog log where
the main thread is, call the worker's last words, and exit 1; one that keeps coming round does not; 0 is off."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from gpu_worker.serve.watchdog import StallWatchdog

pytestmark = pytest.mark.unit


def watch(stall_s: float, last_tick, seconds: float) -> list[str]:
    """Run a watchdog for `seconds`; -> what happened, in order ("on_stall", "exit 1")."""
    events: list[str] = []
    done = threading.Event()

    def exit_process(code: int) -> None:
        events.append(f"exit {code}")
        done.set()

    StallWatchdog("w-test", last_tick, stall_s, on_stall=lambda: events.append("on_stall"),
                  exit_process=exit_process).start()
    done.wait(seconds)
    return events


def test_a_stalled_main_loop_is_logged_with_its_stack_and_ends_the_process(caplog):
    ticked = time.monotonic()
    with caplog.at_level(logging.CRITICAL, logger="kvfleet.worker"):
        assert watch(0.3, lambda: ticked, 5.0) == ["on_stall", "exit 1"]
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    message = record.getMessage()
    assert "w-test is hung: its main loop has not come round for" in message
    assert "test_a_stalled_main_loop_is_logged_with_its_stack" in message  # where this (main) thread was


def test_a_main_loop_that_comes_round_is_left_alone_and_zero_is_off():
    assert watch(0.3, time.monotonic, 1.0) == []  # a turn just now, every time it looks
    assert watch(0.0, lambda: 0.0, 0.5) == []  # off: it never looks


def test_it_exits_even_when_the_last_words_fail():
    events: list[str] = []
    done = threading.Event()

    def fail() -> None:
        raise ConnectionError("Redis away")

    StallWatchdog("w-test", lambda: 0.0, 0.1, on_stall=fail,
                  exit_process=lambda code: (events.append(f"exit {code}"), done.set())).start()
    assert done.wait(5) and events == ["exit 1"]
