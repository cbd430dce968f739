"""The chaos soak's own pieces that need no fleet: how an answer compares with the reference, the Redis
outage windows that excuse a 503, the --duration flag, each fault kind covered first."""

from __future__ import annotations

import argparse

import pytest

from services.chaos.command import duration
from services.chaos.faults import KINDS, FaultLog
from services.chaos.report import _compare

pytestmark = pytest.mark.unit


def test_compare_tells_duplicated_skipped_and_mismatch():
    assert _compare(["abc", "de"], ["abc", "de"]) == ""
    assert _compare(["abcabc", "de"], ["abc", "de"]) == "duplicated"
    assert _compare(["ab", "de"], ["abc", "de"]) == "skipped"
    assert _compare(["abd", "de"], ["abc", "de"]) == "mismatch"
    assert _compare(["abc"], ["abc", "de"]) == "mismatch"


def test_a_503_is_excused_only_when_its_request_overlaps_an_outage():
    log = FaultLog(redis_windows=[(100.0, 125.0)])
    assert log.in_redis_outage(90.0, 101.0) and log.in_redis_outage(124.0, 130.0)
    assert not log.in_redis_outage(90.0, 99.0) and not log.in_redis_outage(126.0, 130.0)


def test_duration_flag():
    assert duration("90") == 90 and duration("90s") == 90 and duration("10m") == 600 and duration("1h") == 3600
    with pytest.raises(argparse.ArgumentTypeError, match="--duration"):
        duration("ten minutes")


def test_kinds_are_the_injectors_methods():
    from services.chaos.faults import Injector

    assert all(callable(getattr(Injector, k, None)) for k in KINDS)
