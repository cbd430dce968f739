"""The statistics of `kvfleet bench serve` (pure Python, no numpy): percentiles, summaries of latency samples,
service-level objectives and goodput, and seeded Poisson arrival times."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}  # --slo key -> SLO field


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between the closest ranks, as numpy's
    default (`np.percentile(values, q)`, method "linear")."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """One metric over a run's requests (seconds)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary | None:
        """None for no values (no request of the run got that far)."""
        vs = list(values)
        if not vs:
            return None
        return cls(count=len(vs), mean=math.fsum(vs) / len(vs), p50=percentile(vs, 50), p90=percentile(vs, 90),
                   p99=percentile(vs, 99), max=max(vs))


@dataclass(frozen=True)
class SLO:
    """Per-request objectives, in seconds; None: not part of the objective."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """`ttft=0.5,tpot=0.05` (seconds; keys ttft, tpot, e2e)."""
        fields: dict[str, float] = {}
        for part in (text or "").split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"--slo: {part.strip()!r} is not KEY=SECONDS with KEY one of "
                                 f"{', '.join(SLO_KEYS)} (e.g. --slo ttft=0.5,tpot=0.05)")
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(f"--slo {key}: {value.strip()!r} is not a number of seconds") from None
            if not seconds > 0:
                raise ValueError(f"--slo {key}: must be > 0 seconds, got {value.strip()}")
            fields[SLO_KEYS[key]] = seconds
        return cls(**fields)

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def met(self, ttft_s: float, tpot_s: float | None, e2e_s: float) -> bool:
        """Does one successful request meet every objective that is set? (A 1-token request has no TPOT: it
        meets any TPOT objective.)"""
        return ((self.ttft_s is None or ttft_s <= self.ttft_s)
                and (self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s)
                and (self.e2e_s is None or e2e_s <= self.e2e_s))

    def describe(self) -> str:
        parts = [f"{k}<={getattr(self, f) * 1000:g}ms" for k, f in SLO_KEYS.items() if getattr(self, f) is not None]
        return ", ".join(parts) or "none"


def goodput(outcomes: Iterable[tuple[float, float | None, float]], slo: SLO, duration_s: float) -> float:
    """Requests per second that met the SLO: `outcomes` holds (ttft_s, tpot_s or None, e2e_s) of each
    successful request; with no objective set every one counts."""
    if duration_s <= 0:
        raise ValueError(f"goodput needs a positive duration, got {duration_s}")
    return sum(1 for o in outcomes if slo.met(*o)) / duration_s


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start, non-decreasing) of n requests at `rate` requests/s: exponential
    gaps of mean 1/rate drawn from a RNG seeded with `seed` (the same seed gives the same times). The first
    request arrives at 0. rate = inf: all at once."""
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def saturated(prev_output_tok_s: float, output_tok_s: float, first_ttft_p50_s: float, ttft_p50_s: float, *,
              min_growth: float = 1.1, ttft_blowup: float = 10.0) -> bool:
    """Is a rate sweep past saturation? Its last point's output throughput grew less than `min_growth` times
    over the point before, or its TTFT p50 is `ttft_blowup` times the first point's (and over a second)."""
    return output_tok_s < min_growth * prev_output_tok_s or (ttft_p50_s > ttft_blowup * first_ttft_p50_s
                                                            and ttft_p50_s > 1.0)
