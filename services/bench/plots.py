"""Charts as one self-contained HTML file with inline SVG (no matplotlib, no scripts, no network).

The benchmarks (`kvfleet bench serve`, `kvfleet bench fleet-sim`) draw with this module:

    from services.bench.plots import CdfChart, LineChart, Series, write_html
    write_html("out.html", "Serving benchmark", [
        LineChart("TTFT against rate", "requests/s", "seconds",
                  [Series("p50", [1, 2, 4], [0.1, 0.2, 0.9]), Series("p99", [1, 2, 4], [0.3, 0.5, 2.0])],
                  log_y=True),
        CdfChart("TTFT distribution", "seconds", {"kvfleet": [0.1, 0.12, 0.3], "vllm": [0.2, 0.25]}),
    ])

A `LineChart` draws several named y series over x (points joined in x order); `CdfChart` draws the
empirical cumulative distribution of each named sample list. `svg(chart)` gives one chart's `<svg>`
element for callers that embed charts elsewhere.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WIDTH, HEIGHT = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 170, 40, 50  # margins: the legend sits on the right
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True)
class Series:
    """One named line: y[i] at x[i]."""

    name: str
    x: Sequence[float]
    y: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(
                f"series {self.name!r}: x has {len(self.x)} points but y has {len(self.y)}; give one y per x"
            )


@dataclass(frozen=True)
class LineChart:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    log_x: bool = False
    log_y: bool = False
    markers: bool = True


@dataclass(frozen=True)
class CdfChart:
    """The empirical CDF of each named list of samples (y: fraction of samples <= x)."""

    title: str
    x_label: str
    samples: Mapping[str, Sequence[float]]
    log_x: bool = False
    y_label: str = field(default="fraction of requests")


def write_html(
    path: str | Path, title: str, charts: Sequence[LineChart | CdfChart], notes: Sequence[str] = ()
) -> Path:
    """Write `charts` (and `notes`, one paragraph each) as one HTML page at `path`; return the path."""
    path = Path(path)
    body = "\n".join(f"<p>{html.escape(n)}</p>" for n in notes)
    body += "\n".join(f"<figure>{svg(c)}</figure>" for c in charts)
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}figure{margin:1em 0}</style></head>\n"
        f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def svg(chart: LineChart | CdfChart) -> str:
    """One chart as an `<svg>` element."""
    if isinstance(chart, CdfChart):
        chart = _cdf_as_lines(chart)
    return _render(chart)


def _cdf_as_lines(chart: CdfChart) -> LineChart:
    series = []
    for name, samples in chart.samples.items():
        values = sorted(float(v) for v in samples if math.isfinite(v) and (v > 0 or not chart.log_x))
        xs: list[float] = []
        ys: list[float] = []
        for i, v in enumerate(values):  # a step function: up at each sample
            xs += [v, v]
            ys += [i / len(values), (i + 1) / len(values)]
        series.append(Series(name, xs, ys))
    return LineChart(chart.title, chart.x_label, chart.y_label, series, log_x=chart.log_x, markers=False)


class _Axis:
    """Maps data values onto pixels, linearly or by log10, and picks tick values."""

    def __init__(self, values: Sequence[float], log: bool, lo_px: float, hi_px: float):
        self.log = log
        finite = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
        lo, hi = (min(finite), max(finite)) if finite else (1.0, 10.0)
        if log:
            lo, hi = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
            hi = hi if hi > lo else lo + 1
        else:
            lo = min(lo, 0.0) if lo >= 0 else lo  # linear axes start at zero for positive data
            hi = hi if hi > lo else lo + 1.0
            step = _nice_step((hi - lo) / 5)
            lo, hi = math.floor(lo / step) * step, math.ceil(hi / step) * step
            self.step = step
        self.lo, self.hi, self.lo_px, self.hi_px = lo, hi, lo_px, hi_px

    def px(self, v: float) -> float:
        t = math.log10(v) if self.log else v
        return self.lo_px + (t - self.lo) / (self.hi - self.lo) * (self.hi_px - self.lo_px)

    def ticks(self) -> list[float]:
        if self.log:  # each power of ten; 2x and 5x too when the axis spans at most two decades
            steps = (1, 2, 5) if self.hi - self.lo <= 2 else (1,)
            return [
                m * 10.0**e
                for e in range(int(self.lo), int(self.hi) + 1)
                for m in steps
                if m * 10.0**e <= 10.0**self.hi
            ]
        n = round((self.hi - self.lo) / self.step)
        return [self.lo + i * self.step for i in range(n + 1)]

    def usable(self, v: float) -> bool:
        return math.isfinite(v) and (v > 0 or not self.log)


def _nice_step(raw: float) -> float:
    exp = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * exp:
            return m * exp
    return 10 * exp


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.0e}"
    return f"{v:.4g}"


def _render(chart: LineChart) -> str:
    x_all = [v for s in chart.series for v in s.x]
    y_all = [v for s in chart.series for v in s.y]
    xa = _Axis(x_all, chart.log_x, LEFT, WIDTH - RIGHT)
    ya = _Axis(y_all, chart.log_y, HEIGHT - BOTTOM, TOP)
    e = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f"<title>{e(chart.title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2:.0f}" y="22" text-anchor="middle" font-size="15">{e(chart.title)}</text>',
    ]
    for t in xa.ticks():
        x = xa.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in ya.ticks():
        y = ya.px(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(
        f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
        'fill="none" stroke="#444"/>'
    )
    out.append(
        f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 12}" text-anchor="middle">{e(chart.x_label)}</text>'
    )
    out.append(
        f'<text transform="translate(16 {(TOP + HEIGHT - BOTTOM) / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle">{e(chart.y_label)}</text>'
    )
    for i, s in enumerate(chart.series):
        color = COLORS[i % len(COLORS)]
        pts = sorted(
            ((a, b) for a, b in zip(s.x, s.y, strict=True) if xa.usable(a) and ya.usable(b)),
            key=lambda p: p[0],
        )
        if pts:
            coords = " ".join(f"{xa.px(a):.1f},{ya.px(b):.1f}" for a, b in pts)
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"><title>{e(s.name)}</title></polyline>'
            )
        if chart.markers:
            for a, b in pts:
                out.append(
                    f'<circle cx="{xa.px(a):.1f}" cy="{ya.px(b):.1f}" r="3" fill="{color}">'
                    f"<title>{e(s.name)}: {_fmt(a)}, {_fmt(b)}</title></circle>"
                )
        ly = TOP + 10 + 18 * i
        lx = WIDTH - RIGHT + 12
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 20}" y2="{ly}" stroke="{color}" stroke-width="3"/>')
        out.append(f'<text x="{lx + 26}" y="{ly + 4}">{e(s.name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
