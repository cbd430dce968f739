"""The statistics of `kvfleet bench serve`: percentiles (against numpy), summaries, SLO parsing, goodput,
seeded Poisson arrivals, the sweep's saturation test."""

import math
import random

import numpy as np
import pytest

from services.bench.stats import SLO, Summary, goodput, percentile, poisson_arrivals, saturated

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("values", [
    [3.0],
    [1.0, 2.0],
    [5.0, 1.0, 4.0, 2.0, 3.0],
    [0.1 * i for i in range(100)],
    [random.Random(7).lognormvariate(0, 1) for _ in range(1001)],
])
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_equals_numpys_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_on_known_data():
    assert percentile([10, 20, 30, 40], 50) == 25
    assert percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summary():
    s = Summary.of([4.0, 1.0, 3.0, 2.0])
    assert (s.count, s.mean, s.p50, s.max) == (4, 2.5, 2.5, 4.0)
    assert s.p50 <= s.p90 <= s.p99 <= s.max
    assert Summary.of([]) is None


def test_slo_parse():
    assert SLO.parse("ttft=0.5,tpot=0.05") == SLO(ttft_s=0.5, tpot_s=0.05)
    assert SLO.parse(" E2E = 2 ") == SLO(e2e_s=2.0)
    assert SLO.parse("") == SLO() and not SLO().is_set()
    assert SLO.parse("ttft=0.5,tpot=0.05").describe() == "ttft<=500ms, tpot<=50ms"
    for bad, says in (("ttft", "KEY=SECONDS"), ("itl=1", "ttft, tpot, e2e"), ("ttft=fast", "not a number"),
                      ("tpot=0", "> 0")):
        with pytest.raises(ValueError, match=says):
            SLO.parse(bad)


def test_goodput_counts_requests_meeting_every_objective():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    outcomes = [
        (0.1, 0.01, 1.0),  # meets both
        (0.5, 0.05, 1.0),  # at the bounds: meets both
        (0.6, 0.01, 1.0),  # TTFT too slow
        (0.1, 0.06, 1.0),  # TPOT too slow
        (0.2, None, 0.2),  # one token, no TPOT: meets the TPOT objective
    ]
    assert goodput(outcomes, slo, duration_s=2.0) == pytest.approx(3 / 2.0)
    assert goodput(outcomes, SLO(), duration_s=5.0) == pytest.approx(1.0)  # no objective: all count
    assert goodput(outcomes, SLO(e2e_s=0.5), duration_s=1.0) == 1.0
    with pytest.raises(ValueError, match="positive duration"):
        goodput(outcomes, slo, duration_s=0)


def test_poisson_arrivals_seeded_and_reproducible():
    a = poisson_arrivals(100, rate=4.0, seed=1)
    assert a == poisson_arrivals(100, rate=4.0, seed=1)
    assert a != poisson_arrivals(100, rate=4.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert poisson_arrivals(3, rate=math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(0, rate=1.0, seed=0) == []
    with pytest.raises(ValueError, match="request-rate"):
        poisson_arrivals(3, rate=0, seed=0)


@pytest.mark.parametrize("rate", [0.5, 8.0, 200.0])
def test_poisson_mean_gap_is_one_over_rate(rate):
    n = 20_000
    times = poisson_arrivals(n, rate=rate, seed=3)
    gaps = np.diff(times)
    # the mean of 20k exponential gaps has a relative standard error of 1/sqrt(20k) = 0.7%: 5% is > 7 sigma
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # exponential: the standard deviation equals the mean
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)


def test_saturated():
    assert not saturated(100.0, 190.0, first_ttft_p50_s=0.1, ttft_p50_s=0.2)  # throughput still grows
    assert saturated(100.0, 105.0, first_ttft_p50_s=0.1, ttft_p50_s=0.2)  # it stopped growing
    assert saturated(100.0, 190.0, first_ttft_p50_s=0.1, ttft_p50_s=1.5)  # TTFT exploded
    assert not saturated(100.0, 190.0, first_ttft_p50_s=0.01, ttft_p50_s=0.5)  # 50x, but under a second
