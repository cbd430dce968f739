"""services.bench.plots: the HTML page parses, each chart is a valid SVG holding its series, log axes and CDFs
come out right, and bad input is refused."""

import math
import re
import xml.etree.ElementTree as ET

import pytest

from services.bench.plots import CdfChart, LineChart, Series, svg, write_html

pytestmark = pytest.mark.unit
SVG_NS = "{http://www.w3.org/2000/svg}"


def _points(root: ET.Element) -> list[list[tuple[float, float]]]:
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()]
            for line in root.iter(f"{SVG_NS}polyline")]


def test_page_holds_one_valid_svg_per_chart(tmp_path):
    charts = [
        LineChart("TTFT <against> rate", "req/s", "seconds",
                  [Series("kvfleet p50", [1, 2, 4], [0.1, 0.2, 0.9]), Series("vLLM & co", [1, 2, 4], [0.3, 0.5, 2])],
                  log_y=True),
        CdfChart("TTFT distribution", "seconds", {"kvfleet": [0.3, 0.1, 0.2], "vLLM": [0.25]}),
    ]
    path = write_html(tmp_path / "sub" / "plots.html", "bench & serve", charts, notes=["CPU: <AMD>"])
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "bench &amp; serve" in page and "CPU: &lt;AMD&gt;" in page
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) == 2
    roots = [ET.fromstring(s) for s in svgs]  # well-formed XML, so escaped titles and names
    assert all(r.tag == f"{SVG_NS}svg" for r in roots)
    texts = ["".join(r.itertext()) for r in roots]
    assert "TTFT <against> rate" in texts[0] and "vLLM & co" in texts[0] and "kvfleet p50" in texts[0]
    assert len(_points(roots[0])) == 2 and len(_points(roots[1])) == 2


def test_line_points_map_monotonically_and_log_axis_ticks_are_powers_of_ten():
    root = ET.fromstring(svg(LineChart("t", "x", "y", [Series("s", [4, 1, 2], [100, 1, 10])], log_y=True)))
    (pts,) = _points(root)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    assert xs == sorted(xs)  # joined in x order
    assert ys[0] > ys[1] > ys[2]  # larger y is higher up (smaller pixel y)
    assert ys[0] - ys[1] == pytest.approx(ys[1] - ys[2], abs=0.2)  # 1, 10, 100 evenly spaced on a log axis
    labels = {t.text for t in root.iter(f"{SVG_NS}text")}
    assert {"1", "10", "100"} <= labels


def test_cdf_is_a_step_function_from_zero_to_one():
    chart = CdfChart("c", "s", {"a": [3.0, 1.0, 2.0, math.nan]})
    (pts,) = _points(ET.fromstring(svg(chart)))
    assert len(pts) == 6  # three finite samples, two points each
    ys = [p[1] for p in pts]
    assert ys == sorted(ys, reverse=True)  # the fraction only grows (pixel y only falls)


def test_empty_and_bad_input():
    ET.fromstring(svg(LineChart("nothing", "x", "y", [])))  # an empty chart still draws its axes
    ET.fromstring(svg(CdfChart("nothing", "x", {"a": []})))
    with pytest.raises(ValueError, match="one y per x"):
        Series("s", [1, 2], [1])
