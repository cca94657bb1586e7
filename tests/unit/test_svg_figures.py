"""The SVG figures on every page (`launcher.report.svg`), read back as XML: each shape where its
figure puts it, a failing tensor crossed and never coloured as bitwise equal."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from launcher.report import svg

NS = {"s": "http://www.w3.org/2000/svg"}


def _parse(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert float(root.get("width")) > 300 and float(root.get("height")) > 100  # a natural size for <img>
    return root


def _shapes(root: ET.Element, key: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.get(key) is not None]


def _luminance(fill: str) -> float:
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b


def test_phase_bars_are_as_long_as_the_phases_in_run_order_rank_0_on_top():
    seconds = [{"fixture": 0.2, "golden": 0.1, "layer": 0.4, "compare": 0.05}, {"fixture": 0.1, "layer": 0.8}]
    root = _parse(svg.phase_times(seconds))
    bars = _shapes(root, "data-phase")
    got = [(int(b.get("data-rank")), b.get("data-phase")) for b in bars]
    assert got == [(0, "fixture"), (0, "golden"), (0, "layer"), (0, "compare"), (1, "fixture"), (1, "layer")]
    width = {(int(b.get("data-rank")), b.get("data-phase")): float(b.get("width")) for b in bars}
    assert width[(1, "layer")] == pytest.approx(2 * width[(0, "layer")], rel=1e-3)
    assert width[(0, "fixture")] == pytest.approx(2 * width[(1, "fixture")], rel=1e-3)
    x = {(int(b.get("data-rank")), b.get("data-phase")): float(b.get("x")) for b in bars}
    assert x[(0, "layer")] == pytest.approx(x[(0, "fixture")] + width[(0, "fixture")] + width[(0, "golden")], abs=0.02)
    y = {int(b.get("data-rank")): float(b.get("y")) for b in bars}
    assert y[0] < y[1]
    tips = [b.find("s:title", NS).text for b in bars]
    assert "rank 1: layer 0.8 s" in tips
    legend = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"fixture", "golden", "layer", "compare"} <= set(legend) and "gather" not in legend


def test_phase_times_of_a_rank_without_figures_and_many_ranks():
    root = _parse(svg.phase_times([None, {"fixture": 0.0}] + [{"fixture": 1.0}] * 62))
    ranks = {int(b.get("data-rank")) for b in _shapes(root, "data-phase")}
    assert 0 not in ranks and ranks == set(range(1, 64))
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.get("text-anchor") == "end"]
    assert labels[0] == "0" and labels[-1] == "63" and len(labels) <= 32


@pytest.mark.parametrize("hi, last", [(0.37, 0.4), (1.0, 1.0), (12.0, 12.0), (0.0, 1.0), (0.0012, 0.0012)])
def test_linear_ticks_cover_the_largest_value(hi, last):
    ticks = svg.linear_ticks(hi)
    assert ticks[0] == 0 and ticks[-1] == pytest.approx(last) and ticks[-1] >= hi and 3 <= len(ticks) <= 8


def test_sweep_map_crosses_failing_tensors_and_colours_by_size():
    labels = ["0 swa FAIL", "1 swa PASS", "2 csa ERROR"]
    tensors = ["kv_cache", "x_out"]
    diffs = [[0.0, 0.5], [1e-4, 0.0], [None, None]]
    failed = [[False, True], [False, False], [False, False]]
    root = _parse(svg.sweep_map(labels, tensors, diffs, failed))
    cells = {(int(c.get("data-job")), c.get("data-tensor")): c for c in root.iter("{http://www.w3.org/2000/svg}rect")
             if c.get("data-failed") is not None}
    assert len(cells) == 6
    assert cells[(0, "kv_cache")].get("fill") == svg.BITWISE == cells[(1, "x_out")].get("fill")
    assert cells[(2, "kv_cache")].get("fill") == svg.EMPTY == cells[(2, "x_out")].get("fill")
    big, small = cells[(0, "x_out")].get("fill"), cells[(1, "kv_cache")].get("fill")
    assert big not in (svg.BITWISE, svg.EMPTY) and _luminance(big) < _luminance(small)  # larger diff, darker
    assert [k for k, c in cells.items() if c.get("data-failed") == "true"] == [(0, "x_out")]
    crosses = [(int(t.get("data-job")), t.get("data-tensor")) for t in root.iter("{http://www.w3.org/2000/svg}text")
               if t.text == "\u2716" and t.get("data-job") is not None]
    assert crosses == [(0, "x_out")]
    assert "0 swa FAIL, x_out: max |diff| 0.5, FAILED" == cells[(0, "x_out")].find("s:title", NS).text


def test_sweep_map_a_failing_tensor_that_is_bitwise_equal_still_shows_its_cross():
    """Whatever its max |diff|, a failing tensor shows its cross: the colour alone never says
    that a tensor passed."""
    root = _parse(svg.sweep_map(["0 FAIL"], ["x_out"], [[0.0]], [[True]]))
    (cell,) = [c for c in root.iter("{http://www.w3.org/2000/svg}rect") if c.get("data-failed") == "true"]
    assert cell.get("fill") == svg.BITWISE
    assert any(t.text == "\u2716" for t in root.iter("{http://www.w3.org/2000/svg}text"))


def test_diff_colours_span_the_scale_and_clip_outside_it():
    lo, hi = svg.diff_range([[1e-6, None], [1e-2, 0.0]])
    assert (lo, hi) == (1e-6, 1e-2)
    assert svg.diff_colour(1e-6, lo, hi) == svg.DIFF_COLOURS[0] == svg.diff_colour(1e-9, lo, hi)
    assert svg.diff_colour(1e-2, lo, hi) == svg.DIFF_COLOURS[-1] == svg.diff_colour(float("inf"), lo, hi)
    shades = [_luminance(svg.diff_colour(10.0 ** k, lo, hi)) for k in range(-6, -1)]
    assert shades == sorted(shades, reverse=True)
    lone = svg.diff_range([[3e-3]])  # one value: a decade around it, so it sits mid-scale
    assert lone[1] / lone[0] == pytest.approx(10) and lone[0] < 3e-3 < lone[1]


def test_labels_are_escaped():
    root = _parse(svg.sweep_map(["0 <b>&"], ["x<y"], [[0.1]], [[False]]))
    assert "0 <b>&" in [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
