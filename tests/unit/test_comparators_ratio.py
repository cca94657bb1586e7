"""Tests of launcher.verify's comparators: ratio_allclose (§13.3), ratio_reldiff (§13.4, the boundaries
of §10.2) and their valid rows, axis and zero tail (§13.5).

Numeric rules are checked against the naive restatements of `tests.unit.comparator_helpers`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from launcher.verify import exact, ratio_allclose, ratio_reldiff

from .comparator_helpers import call, t, f32, naive_ratio_allclose, naive_reldiff


# -- §13.3 ratio_allclose ----------------------------------------------------------------------


def test_a1_within_tolerance():
    assert call(ratio_allclose(atol=1e-2, rtol=1e-2), t([1, 2, 3]), t([1.001, 2.002, 3.003]))[0]


def test_a2_a3_outlier_budget():
    e = torch.zeros(100)
    a = e.clone()
    a[0] = 10
    assert call(ratio_allclose(atol=1e-3, rtol=1e-3, max_error_ratio=0.05), a, e)[0]
    a[:10] = 10
    ok, detail = call(ratio_allclose(atol=1e-3, rtol=1e-3, max_error_ratio=0.05), a, e)
    assert not ok and "ratio_allclose fail" in detail and "error_count=10/100" in detail
    assert "threshold=5 pts" in detail and "max abs diff=10 at (0,) (tol=0.001)" in detail


@pytest.mark.parametrize("side", ["actual", "expected"])
@pytest.mark.parametrize("value,counts", [(math.nan, "NaN=1 Inf=0"), (math.inf, "NaN=0 Inf=1")])
def test_a4_nonfinite_fails_with_per_side_counts(side, value, counts):
    a, e = torch.zeros(2), torch.zeros(2)
    (a if side == "actual" else e)[0] = value
    ok, detail = call(ratio_allclose(atol=1, rtol=1, max_error_ratio=1), a, e)
    assert not ok and "illegal values in comparison" in detail and f"{side}: {counts}" in detail


def test_a5_ratio_out_of_range():
    with pytest.raises(ValueError, match="max_error_ratio"):
        ratio_allclose(max_error_ratio=1.5)


def test_a6_factory_tolerances_override_call_time():
    assert call(ratio_allclose(atol=1.0, rtol=0.0), t([1.0]), t([1.5]))[0]
    assert not call(ratio_allclose(), t([1.0]), t([1.5]))[0]


def test_ratio_allclose_matches_naive_restatement():
    g = torch.Generator().manual_seed(1)
    e = torch.randn(6, 50, generator=g)
    # diffs straddling the tolerance, including exact hits of atol + rtol*|e|
    a = e + (torch.randint(-3, 4, e.shape, generator=g) * 0.25e-2) * (1 + e.abs())
    for atol, rtol, ratio in ((1e-3, 1e-2, 0.0), (2.5e-3, 2.5e-3, 0.05), (0.0, 1 / 128, 0.3), (1e-2, 0.0, 0.5)):
        passed, n_bad, threshold = naive_ratio_allclose(a, e, atol, rtol, ratio)
        v = ratio_allclose(atol=atol, rtol=rtol, max_error_ratio=ratio).evaluate(a, e)
        assert (v.passed, v.figures["n_bad"], v.figures["threshold"]) == (passed, n_bad, threshold)


# -- §13.4 ratio_reldiff -----------------------------------------------------------------------


def test_r1_r2_relative_and_absolute_branches():
    assert call(ratio_reldiff(0.01, 0.0), t([100, 200]), t([100.5, 201]))[0]
    assert call(ratio_reldiff(0.01, 0.0), t([1e-6]), t([5e-3]))[0]


def test_r3_budget():
    e = torch.full((100,), 100.0)
    a = e.clone()
    a[:10] = 200
    ok, detail = call(ratio_reldiff(0.01, 0.05), a, e)
    assert not ok and "ratio_reldiff fail" in detail and "error_count=10/100" in detail


def test_r4_cap():
    e = torch.full((100,), 100.0)
    a = e.clone()
    a[0] = 10000
    ok, detail = call(ratio_reldiff(0.01, 0.05, 0.1), a, e)
    assert not ok and "max_diff_hd" in detail and "worst rdiff=0.99 >= max_diff_hd=0.1" in detail
    assert "error_count" not in detail.splitlines()[0]


def test_r5_symmetric_denominator():
    assert call(ratio_reldiff(0.6, 0.0), t([2.0]), t([1.0]))[0]


@pytest.mark.parametrize("side", ["actual", "expected"])
@pytest.mark.parametrize("value,counts", [(math.nan, "NaN=1 Inf=0"), (math.inf, "NaN=0 Inf=1")])
def test_r6_nonfinite(side, value, counts):
    a, e = torch.zeros(2), torch.zeros(2)
    (a if side == "actual" else e)[0] = value
    ok, detail = call(ratio_reldiff(1, 1), a, e)
    assert not ok and "illegal values in comparison" in detail and f"{side}: {counts}" in detail


@pytest.mark.parametrize("kwargs,name", [({"diff_thd": 0}, "diff_thd"), ({"pct_thd": 1.5}, "pct_thd"),
                                         ({"max_diff_hd": 0}, "max_diff_hd")])
def test_r7_factory_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ratio_reldiff(**kwargs)


def test_reldiff_boundaries_of_10_2():
    cap1 = ratio_reldiff(3e-3, 1.0, 1)
    # expected 0: actual 0.05 -> rdiff exactly 1.0 (fails the cap), 0.025 -> 0.99999994, 0.01 -> floor
    v = cap1.evaluate(t([0.05]), t([0.0]))
    assert not v.passed and v.kind == "cap" and v.figures["worst_rdiff"] == 1.0
    v = cap1.evaluate(t([0.025]), t([0.0]))
    assert v.passed and v.figures["worst_rdiff"] == float(np.nextafter(f32(1.0), f32(0.0)))
    v = cap1.evaluate(t([0.01]), t([0.0]))
    assert v.passed and v.figures["worst_rdiff"] == pytest.approx(0.01 / 0.0203450520833, rel=1e-6)
    assert cap1.floor == pytest.approx(0.020345052083333)
    # an exact negation reaches rdiff 2.0: the (HCA a2a3sim) cap of 2 fails only there
    cap2 = ratio_reldiff(4e-3, 1.0, 2)
    assert not cap2.evaluate(t([0.5]), t([-0.5])).passed
    assert cap2.evaluate(t([0.5]), t([-0.49])).passed
    # |values| >= 1: relative rule to the larger magnitude; < 1: absolute rule
    strict = ratio_reldiff(3e-3, 0.0)
    assert strict.evaluate(t([100.0]), t([100.3])).passed
    assert not strict.evaluate(t([100.0]), t([100.4])).passed
    assert not strict.evaluate(t([0.5]), t([0.5035])).passed
    assert strict.evaluate(t([0.5]), t([0.5025])).passed


def test_ratio_reldiff_matches_naive_restatement():
    g = torch.Generator().manual_seed(2)
    e = torch.rand(8, 40, generator=g) * 4 - 2
    e[0, :8] = 0.0
    steps = torch.randint(-4, 5, e.shape, generator=g).float()
    a = e + steps * 1.5e-3 * torch.where(e.abs() > 1, e.abs(), torch.ones_like(e))
    a[1, :5] = -e[1, :5]  # sign flips
    a[2, :3] = e[2, :3] + 3e-3  # diff exactly near the threshold
    for thd, pct, cap in ((3e-3, 0.008, 1), (4e-3, 0.3, 2), (1e-2, 0.05, math.inf), (3e-3, 0.5, 1.5)):
        passed, n_bad, worst = naive_reldiff(a, e, thd, pct, cap)
        v = ratio_reldiff(thd, pct, cap).evaluate(a, e)
        assert (v.passed, v.figures["n_bad"]) == (passed, n_bad)
        assert v.figures["worst_rdiff"] == pytest.approx(worst, rel=0, abs=0)


# -- §13.5 valid_rows / valid_axis / zero_tail ------------------------------------------------


def test_w1_valid_rows_restricts_ratio_allclose():
    e = torch.zeros(10, 4)
    a = e.clone()
    a[5:] = 99
    assert not call(ratio_allclose(atol=1e-3, rtol=0.0), a, e)[0]
    assert call(ratio_allclose(atol=1e-3, rtol=0.0, valid_rows=5), a, e)[0]


def test_w2_w3_zero_tail():
    e = torch.zeros(10, 2)
    a = e.clone()
    a[7, 1] = 1
    ok, detail = call(ratio_allclose(atol=1e-3, rtol=0.0, valid_rows=5, zero_tail=True), a, e)
    assert not ok and "inactive tail contains 1 nonzero" in detail
    v = ratio_allclose(valid_rows=5, zero_tail=True).evaluate(a, e)
    assert v.kind == "zero_tail" and v.category == "implementation"
    assert call(ratio_allclose(valid_rows=5, zero_tail=True), e.clone(), e)[0]


def test_w4_valid_axis():
    e = torch.zeros(2, 10, 4)
    a = e.clone()
    a[:, 5:] = 99
    assert call(ratio_allclose(atol=1e-3, rtol=0.0, valid_rows=5, valid_axis=1), a, e)[0]


def test_w5_valid_rows_restricts_ratio_reldiff():
    e = torch.ones(10, 4)
    a = e.clone()
    a[5:] = 99
    assert not call(ratio_reldiff(1e-3, 0.0), a, e)[0]
    assert call(ratio_reldiff(1e-3, 0.0, valid_rows=5), a, e)[0]


def test_w6_zero_valid_rows_pass_vacuously():
    a, e = torch.ones(4, 2), torch.zeros(4, 2)
    assert call(ratio_allclose(atol=0.0, rtol=0.0, max_error_ratio=0.0, valid_rows=0), a, e)[0]
    assert call(ratio_reldiff(1e-3, 0.0, valid_rows=0), a, e)[0]


def test_w7_valid_rows_out_of_range():
    ok, detail = call(ratio_allclose(valid_rows=9), torch.zeros(4, 2), torch.zeros(4, 2))
    assert not ok and "valid_rows=9 out of range" in detail
    assert ratio_reldiff(valid_rows=9).evaluate(torch.zeros(4, 2), torch.zeros(4, 2)).category == "contract"


def test_w8_labels():
    assert ratio_allclose(valid_rows=5, valid_axis=1).__name__ == (
        "ratio_allclose(atol=None, rtol=None, max_error_ratio=0.005, valid_rows=5, valid_axis=1, zero_tail=False)")
    assert "valid_rows=None" in ratio_allclose().__name__
    assert ratio_reldiff(valid_rows=5, zero_tail=True).__name__ == (
        "ratio_reldiff(diff_thd=0.01, pct_thd=0.05, max_diff_hd=inf, valid_rows=5, valid_axis=0, zero_tail=True)")
    assert ratio_reldiff(3e-3, 0.008, 1).__name__ == (
        "ratio_reldiff(diff_thd=0.003, pct_thd=0.008, max_diff_hd=1, valid_rows=None, valid_axis=0, zero_tail=False)")
