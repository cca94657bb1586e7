"""Tests of launcher.verify's comparators: the reference's own cases (spec validation.md §13.1–§13.7), the
extra cases of §13.10, the boundaries of §10.2, the labels of §8.4 / §9.5 / §10.4, and our
report figures (per-rank attribution, stray rows, NaN and shape handling, speed at FLASH dims).

Numeric rules are checked against naive, loop-based restatements of the spec written here
(numpy float32 scalars reproduce torch's fp32 ops with Python-float scalars).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from launcher.verify import (
    AllClose,
    Comparator,
    Verdict,
    build_comparator,
    build_compare_fn,
    compare_outputs,
    distribution_summary,
    error_distribution,
    exact,
    initial_key,
    mapped_pool_ratio_allclose,
    ratio_allclose,
    ratio_reldiff,
    topk_pair_compare,
    validate_golden,
)
from layers.contract.checks import PoolCheck, RelDiffCheck

CTX = dict(actual_outputs={}, expected_outputs={}, inputs={}, rtol=1e-5, atol=1e-5)


def call(cmp, actual, expected, **overrides):
    return cmp(actual, expected, **{**CTX, **overrides})


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# -- naive restatements of the spec ------------------------------------------------------------

f32 = np.float32


def naive_ratio_allclose(a, e, atol, rtol, ratio):
    """§8.2 point by point: (passed, n_bad, threshold)."""
    n_bad = 0
    for x, y in zip(a.flatten().tolist(), e.flatten().tolist()):
        diff = abs(f32(x) - f32(y))
        tol = f32(atol) + f32(rtol) * abs(f32(y))
        n_bad += bool(diff > tol)
    threshold = round(ratio * a.numel())
    return n_bad <= threshold, n_bad, threshold


def naive_reldiff(a, e, diff_thd, pct_thd, cap):
    """§10.2 point by point: (passed, n_bad, worst rdiff)."""
    floor = f32((1.0 / 2**14) / diff_thd)
    n_bad, worst = 0, 0.0
    for x, y in zip(a.flatten().tolist(), e.flatten().tolist()):
        x, y = f32(x), f32(y)
        diff = abs(x - y)
        if diff < f32(diff_thd):
            rdiff = diff
        else:
            rdiff = diff / (max(abs(x), abs(y), floor) + f32(1e-9))
        if rdiff > f32(diff_thd):
            n_bad += 1
            worst = max(worst, float(rdiff))
    return n_bad <= round(pct_thd * a.numel()) and worst < cap, n_bad, worst


def naive_pool(actual, expected, mapping, block_size, atol, rtol, ratio):
    """§9.2 for a ranked pool with loops: stray rows per rank and the pooled numeric verdict."""
    ranks = actual.shape[0]
    rows = actual.shape[1] * block_size
    a = actual.reshape(ranks, rows, -1).tolist()
    e = expected.reshape(ranks, rows, -1).tolist()
    strays = {r: [] for r in range(ranks)}
    bad_by_rank = {r: 0 for r in range(ranks)}
    numel = 0
    for r in range(ranks):
        written = {m for m in mapping[r].tolist() if m >= 0}
        for row in range(rows):
            if row in written:
                for x, y in zip(a[r][row], e[r][row]):
                    numel += 1
                    bad_by_rank[r] += bool(abs(f32(x) - f32(y)) > f32(atol) + f32(rtol) * abs(f32(y)))
            elif any(not (x == y) for x, y in zip(a[r][row], e[r][row])):
                strays[r].append(row)
    n_bad = sum(bad_by_rank.values())
    passed = not any(strays.values()) and n_bad <= round(ratio * numel)
    return passed, strays, bad_by_rank


# -- §13.1 validate_golden (default allclose) --------------------------------------------------


def test_v1_v2_equal_and_within_tolerance():
    validate_golden({"x": t([1, 2, 3])}, {"x": t([1, 2, 3])})
    validate_golden({"x": t([1, 2, 3])}, {"x": t([1.001, 2.002, 3.003])}, rtol=1e-2, atol=1e-2)


def test_v3_v4_mismatch_messages():
    with pytest.raises(AssertionError, match="does not match golden"):
        validate_golden({"x": t([1, 2, 3])}, {"x": t([2, 3, 4])})
    with pytest.raises(AssertionError) as err:
        validate_golden({"x": t([1, 2, 3, 4])}, {"x": t([1, 200, 3, 400])})
    for s in ("Mismatched elements: 2/4", "actual=", "expected=", "'x' FAIL  shape=(4,) dtype=torch.float32"):
        assert s in str(err.value)


def test_v5_v6_several_outputs_name_the_failing_one():
    validate_golden({"a": t([1.0]), "b": t([2.0])}, {"a": t([1.0]), "b": t([2.0])})
    with pytest.raises(AssertionError) as err:
        validate_golden({"a": t([1.0]), "b": t([3, 4])}, {"a": t([1.0]), "b": t([30, 40])})
    assert str(err.value).startswith("Output(s) does not match golden: ['b']\n  'b' FAIL  shape=(2,)")


def test_v7_rule_is_abs_diff_le_atol_plus_rtol_abs_expected():
    validate_golden({"x": t([1.0])}, {"x": t([1.09])}, rtol=0.0, atol=0.1)
    with pytest.raises(AssertionError):
        validate_golden({"x": t([1.0])}, {"x": t([1.11])}, rtol=0.0, atol=0.1)


def test_v8_bf16_and_v12_defaults():
    x = torch.randn(5).to(torch.bfloat16)
    validate_golden({"x": x}, {"x": x.clone()})
    with pytest.raises(AssertionError):
        validate_golden({"x": t([1.0])}, {"x": t([1.1])})


def test_v9_missing_golden_key_is_key_error():
    with pytest.raises(KeyError):
        validate_golden({"x": t([1.0])}, {"y": t([1.0])})


def test_v10_shape_mismatch_fails_cleanly_naming_both_shapes():
    with pytest.raises(AssertionError) as err:
        validate_golden({"x": t([1.0, 2.0, 3.0])}, {"x": torch.zeros(2, 2)})
    assert "actual=(3,)" in str(err.value) and "expected=(2, 2)" in str(err.value)


def test_v11_nan_never_equals_nan():
    with pytest.raises(AssertionError, match="does not match golden"):
        validate_golden({"x": t([1.0, math.nan])}, {"x": t([1.0, math.nan])})


def test_validate_golden_prints_reference_lines(capsys):
    validate_golden({"a": t([1.0]), "b": t([2.0])}, {"a": t([1.0]), "b": t([2.0])},
                    compare_fn={"b": ratio_allclose()})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[RUN]   'a' PASS  shape=(1,) dtype=torch.float32"
    assert out[1] == f"[RUN]   'b' PASS  shape=(1,) dtype=torch.float32 ({ratio_allclose().__name__})"


# -- §13.2 compare_fn dispatch -----------------------------------------------------------------


def test_c1_c2_custom_comparators():
    always = lambda *a, **k: (True, "")  # noqa: E731
    validate_golden({"x": t([1, 2])}, {"x": t([100, 200])}, compare_fn={"x": always})
    never = lambda *a, **k: (False, "    custom-detail-marker")  # noqa: E731
    with pytest.raises(AssertionError, match="custom-detail-marker"):
        validate_golden({"x": t([1, 2])}, {"x": t([1, 2])}, compare_fn={"x": never})


def test_c3_comparator_sees_the_whole_context():
    seen = {}

    def record(actual, expected, *, actual_outputs, expected_outputs, inputs, rtol, atol):
        seen.update(a=set(actual_outputs), e=set(expected_outputs), i=set(inputs), rtol=rtol, atol=atol)
        return True, ""

    outs = {"a": t([1.0]), "b": t([2.0])}
    validate_golden(outs, dict(outs), rtol=1e-2, atol=1e-3, compare_fn={"a": record}, inputs={"x": t([0.0])})
    assert seen == {"a": {"a", "b"}, "e": {"a", "b"}, "i": {"x"}, "rtol": 1e-2, "atol": 1e-3}


def test_c4_override_one_output_default_for_the_other():
    ok = lambda *a, **k: (True, "")  # noqa: E731
    outs, gold = {"a": t([1.0]), "b": t([1.0])}, {"a": t([9.0]), "b": t([5.0])}
    with pytest.raises(AssertionError, match="'b'"):
        validate_golden(outs, gold, compare_fn={"a": ok})
    validate_golden(outs, gold, compare_fn={"a": ok, "b": ok})


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


# -- §13.6 mapped_pool_ratio_allclose ----------------------------------------------------------


def pool_cmp(mapping_shape, block_size=2, ranked=False, **kwargs):
    kwargs = {"atol": 0.0, "rtol": 0.0, "max_error_ratio": 0.0, **kwargs}
    return mapped_pool_ratio_allclose("m", mapping_shape=mapping_shape, block_size=block_size,
                                      leading_rank_axis=ranked, **kwargs)


def pool_call(cmp, actual, expected, mapping, **inputs):
    return cmp(actual, expected, actual_outputs={}, expected_outputs={}, inputs={"m": mapping, **inputs},
               rtol=0.0, atol=0.0)


def test_m1_matching_minus_inf_rows_pass():
    e = torch.zeros(2, 2, 2)
    e[1] = -math.inf
    assert pool_call(pool_cmp((1,)), e.clone(), e, t([0], torch.int64))[0]


def test_m2_nan_in_mapped_row():
    e = torch.zeros(2, 2, 2)
    a = e.clone()
    a[0, 0, 0] = math.nan
    ok, detail = pool_call(pool_cmp((1,)), a, e, t([0], torch.int64))
    assert not ok and "mapped rows" in detail and "non-finite" in detail
    assert detail.startswith("    actual mapped rows in pool from 'm' contain 1 non-finite value(s)")


def test_m3_stray_row_on_rank_1():
    e = torch.zeros(2, 2, 2, 1)
    a = e.clone()
    a[1, 1, 1, 0] = 1
    ok, detail = pool_call(pool_cmp((2, 1), ranked=True), a, e, t([[0], [1]], torch.int64))
    assert not ok and "rank=1" in detail and "row=3" in detail
    assert detail.splitlines()[0] == "    unmapped physical pool row changed: rank=1 row=3 changed_values=1 mapping='m'"


@pytest.mark.parametrize("mapping,text", [
    (t([-2], torch.int64), "'m'[0]=-2 is invalid; only -1 is a negative sentinel"),
    (t([4], torch.int64), "'m'[0]=4 is outside physical row range [0, 4)"),
    (t([0.0]), "'m' must have an integer dtype, got torch.float32"),
])
def test_m4_bad_mapping_entries(mapping, text):
    e = torch.zeros(2, 2, 1)
    ok, detail = pool_call(pool_cmp((1,)), e.clone(), e, mapping)
    assert not ok and text in detail


def test_m4_ranked_location_format():
    e = torch.zeros(2, 2, 2, 1)
    ok, detail = pool_call(pool_cmp((2, 2), ranked=True), e.clone(), e, t([[0, 1], [1, -3]], torch.int64))
    assert not ok and "'m'[1, 1]=-3 is invalid" in detail


def test_m5_mapping_shape():
    e = torch.zeros(2, 2, 1)
    ok, detail = pool_call(pool_cmp((2,)), e.clone(), e, t([0], torch.int64))
    assert not ok and "must have shape (2,)" in detail


def test_m6_duplicate_row_is_a_fixture_error_naming_the_items():
    e = torch.zeros(2, 2, 1)
    v = pool_cmp((2,)).evaluate(e.clone(), e, inputs={"m": t([1, 1], torch.int64)})
    assert not v.passed and "duplicate physical row 1" in v.detail
    assert v.category == "fixture" and v.figures["first_duplicate"] == {"rank": 0, "row": 1, "items": [0, 1]}


def test_m7_same_row_on_two_ranks_within_atol():
    e = torch.zeros(2, 2, 2, 1)
    a = e.clone()
    a[:, 0, 0, 0] = 0.5
    assert pool_call(pool_cmp((2, 1), ranked=True, atol=0.5), a, e, t([[0], [0]], torch.int64))[0]


def test_pool_factory_errors_and_label():
    with pytest.raises(ValueError, match="mapping_shape"):
        pool_cmp(())
    with pytest.raises(ValueError, match="mapping_shape"):
        pool_cmp((2, 0))
    with pytest.raises(ValueError, match="block_size"):
        pool_cmp((2,), block_size=0)
    with pytest.raises(ValueError, match="leading_rank_axis"):
        pool_cmp((4,), ranked=True)
    label = mapped_pool_ratio_allclose("ori_slot_mapping", mapping_shape=(2, 16), block_size=32,
                                       leading_rank_axis=True, pool_name="KV cache", atol=1e-4, rtol=1 / 128).__name__
    assert label == ("mapped_pool_ratio_allclose(mapping=ori_slot_mapping, shape=(2, 16), block_size=32, "
                     "leading_rank_axis=True, atol=0.0001, rtol=0.0078125, max_error_ratio=0.005)")


def test_pool_structural_messages():
    e = torch.zeros(2, 2, 2, 1)
    m = t([[0], [1]], torch.int64)
    cmp = pool_cmp((2, 1), ranked=True, pool_name="KV cache")
    assert "KV cache shape mismatch: actual=(2, 2, 2, 1) expected=(2, 2, 2)" in pool_call(cmp, e, e[..., 0], m)[1]
    assert "KV cache dtype mismatch" in pool_call(cmp, e, e.double(), m)[1]
    detail = pool_call(pool_cmp((2, 1), block_size=4, ranked=True), e, e, m)[1]
    assert "expected block-major pool layout [ranks, blocks, block_size, ...] with block_size=4" in detail
    assert "compare_fn misconfigured: missing input 'm'" in cmp(e, e, **CTX)[1]
    detail = pool_call(pool_cmp((3, 1), ranked=True), e, e, t([[0], [1], [2]], torch.int64))[1]
    assert "leading rank count of pool must be 3, got 2" in detail
    # a list mapping_shape is normalised (the reference would never match it)
    assert pool_call(pool_cmp([2, 1], ranked=True), e, e, m)[0]


# -- §13.7 topk_pair_compare -------------------------------------------------------------------


def topk(idx_a, idx_e, vals, **kwargs):
    cmp = topk_pair_compare("vals", **kwargs)
    return cmp(t(idx_a, torch.int64), t(idx_e, torch.int64),
               actual_outputs={"vals": vals if isinstance(vals, torch.Tensor) else t(vals)},
               expected_outputs={}, inputs={}, rtol=1e-5, atol=1e-5)


def test_k1_to_k4():
    assert topk([[0, 1, 2]], [[2, 1, 0]], [[3, 2, 1]])[0]
    ok, detail = topk([[0, 1, 2]], [[0, 1, 3]], [[3, 0.5, 1]])
    assert not ok
    for s in ("top-k idx mismatch", "actual_idx=2", "expected_idx=3", "[0,2]"):
        assert s in detail
    assert "actual_vals[1:3]=[0.5, 1]" in detail
    assert topk([[0, 1, 2]], [[0, 1, 2]], [[3, 2, 1]])[0]  # K3: expected vals never consulted
    assert topk([[0, 1], [0, 1]], [[1, 0], [0, 1]], [[5, 5], [2, 1]])[0]


def test_k5_label_and_k7_misconfigured():
    assert topk_pair_compare("vals").__name__ == "topk_pair_compare"
    cmp = topk_pair_compare("typo_vals")
    ok, detail = cmp(t([[0]], torch.int64), t([[0]], torch.int64), actual_outputs={"vals": t([[1.0]])},
                     expected_outputs={}, inputs={}, rtol=0, atol=0)
    assert not ok and "misconfigured" in detail and "typo_vals" in detail


def test_k6_through_validate_golden():
    outs = {"idx": t([[0, 1, 2]], torch.int64), "vals": t([[3.0, 2.0, 1.0]])}
    gold = {"idx": t([[2, 1, 0]], torch.int64), "vals": t([[3.0, 2.0, 1.0]])}
    validate_golden(outs, gold, compare_fn={"idx": topk_pair_compare("vals")})


def test_k8_coordinates_in_original_axes():
    idx_a = [[[0, 1, 2]], [[0, 1, 2]]]
    idx_e = [[[0, 1, 2]], [[0, 1, 3]]]
    vals = [[[3, 2, 1]], [[3, 0.5, 1]]]
    ok, detail = topk(idx_a, idx_e, vals)
    assert not ok and "[1,0,2]" in detail


def test_k9_dim_0():
    idx_e = torch.arange(12).view(3, 4)
    idx_a = idx_e.clone()
    idx_a[1, 0], idx_a[2, 0] = idx_e[2, 0], idx_e[1, 0]
    vals = t([[9, 9, 9, 9], [8, 5, 5, 5], [8, 1, 1, 1]])
    assert topk(idx_a.tolist(), idx_e.tolist(), vals, dim=0)[0]


def test_k10_k11_ascending():
    assert topk([[0, 1, 2]], [[2, 1, 0]], [[1, 2, 3]], descending=False)[0]
    ok, detail = topk([[0, 1, 2]], [[0, 1, 3]], [[1, 3, 2]], descending=False)
    assert not ok and "ascending" in detail


def test_k12_bf16_vals():
    assert topk([[0, 1, 2]], [[0, 1, 2]], t([[3, 2, 1]]).to(torch.bfloat16))[0]


def test_topk_k1_accepts_every_mismatch_and_nan_scores_fail():
    assert topk([[5]], [[7]], [[1.0]])[0]
    ok, detail = topk([[0, 1, 2]], [[0, 9, 2]], [[3.0, math.nan, 1.0]])
    assert not ok and "actual_idx=1" in detail


# -- §13.10 extra cases ------------------------------------------------------------------------


@pytest.mark.parametrize("numel,allowed", [(100, 0), (300, 2), (500, 2)])
def test_threshold_rounds_half_to_even(numel, allowed):
    e = torch.zeros(numel)
    for n_bad in (allowed, allowed + 1):
        a = e.clone()
        a[:n_bad] = 1.0
        v = ratio_allclose(atol=0.1, rtol=0.0).evaluate(a, e)
        assert v.figures["threshold"] == allowed
        assert v.passed == (n_bad <= allowed)


def test_reldiff_diff_equal_to_threshold_is_bad_below_one():
    v = ratio_reldiff(0.25, 0.0).evaluate(t([0.5]), t([0.25]))
    assert not v.passed and v.figures["worst_rdiff"] == pytest.approx(0.5)


def test_ratio_allclose_tolerance_uses_expected_only():
    assert not ratio_allclose(atol=0.0, rtol=0.6, max_error_ratio=0.0).evaluate(t([2.0]), t([1.0])).passed
    assert ratio_allclose(atol=0.0, rtol=0.6, max_error_ratio=0.0).evaluate(t([1.0]), t([2.0])).passed


def ranked_pool(ranks=2, blocks=4, block_size=4, width=8, items=6, seed=0):
    """A ranked pool pair (actual == golden) with an injective per-rank mapping (-1 sprinkled in)."""
    g = torch.Generator().manual_seed(seed)
    rows = blocks * block_size
    mapping = torch.stack([torch.randperm(rows, generator=g)[:items] for _ in range(ranks)])
    mapping[:, -1] = -1
    initial = torch.randn(ranks, blocks, block_size, 1, width, generator=g)
    expected = initial.clone()
    flat = expected.view(ranks, rows, width)
    for r in range(ranks):
        for row in mapping[r].tolist():
            if row >= 0:
                flat[r, row] = torch.randn(width, generator=g)
    return initial, expected, mapping


def test_pooled_budget_hides_a_bad_rank_but_per_rank_names_it():
    initial, e, m = ranked_pool()
    a = e.clone()
    row = int(m[1, 0])
    a.view(2, 16, 8)[1, row, :2] += 1.0  # 2 bad points on rank 1 of 2 * 5 * 8 = 80 mapped values
    cmp = pool_cmp((2, 6), block_size=4, ranked=True, atol=1e-6, max_error_ratio=0.03)  # budget round(2.4) = 2
    v = cmp.evaluate(a, e, inputs={"m": m})
    assert v.passed and v.figures["threshold"] == 2 and v.figures["n_bad"] == 2
    assert [r.n_bad for r in v.per_rank] == [0, 2] and v.figures["ranks_with_bad"] == [1]
    assert any("rank 1: 2/40" in n for n in v.notes)
    assert naive_pool(a, e, m, 4, 1e-6, 0.0, 0.03)[0]


def test_stray_nan_on_both_sides_is_changed():
    e = torch.zeros(2, 2, 1)
    e[1, 0, 0] = math.nan
    v = pool_cmp((1,)).evaluate(e.clone(), e, inputs={"m": t([0], torch.int64), "init": e.clone()})
    assert not v.passed and v.kind == "stray" and "row=2 changed_values=1" in v.detail
    cmp = pool_cmp((1,), initial_name="init")
    v = cmp.evaluate(e.clone(), e, inputs={"m": t([0], torch.int64), "init": e.clone()})
    assert v.figures["stray_by_side"]["neither"] == 1 and v.figures["stray_nan"] == {"actual": 1, "expected": 1}


def test_pool_without_valid_entries():
    e = torch.randn(2, 2, 3)
    m = t([-1, -1], torch.int64)
    assert pool_cmp((2,)).evaluate(e.clone(), e, inputs={"m": m}).passed
    a = e.clone()
    a[1, 1, 2] += 1
    v = pool_cmp((2,)).evaluate(a, e, inputs={"m": m})
    assert not v.passed and "row=3 changed_values=1" in v.detail and " rank=" not in v.detail.splitlines()[0]


def test_minus_one_ignored_ranked_and_other_ranks_row_is_a_stray():
    e = torch.zeros(2, 2, 2, 1)
    m = t([[1, -1], [-1, -1]], torch.int64)
    a = e.clone()
    a[0, 0, 1, 0] = 0.25  # rank 0 writes row 1 (mapped): numeric, atol covers it
    assert pool_cmp((2, 2), ranked=True, atol=0.5).evaluate(a, e, inputs={"m": m}).passed
    a[1, 0, 1, 0] = 0.25  # the same row in rank 1's slice: a stray write of rank 1
    v = pool_cmp((2, 2), ranked=True, atol=0.5).evaluate(a, e, inputs={"m": m})
    assert not v.passed and "rank=1 row=1" in v.detail and [r.stray_rows for r in v.per_rank] == [0, 1]


def test_error_distribution_gates_only_actual_nonfinite(capsys):
    a, e = torch.randn(64), torch.randn(64)
    gate = error_distribution(always_pass=False)
    bad = a.clone()
    bad[3] = math.nan
    ok, detail = call(gate, bad, e)
    assert not ok and "illegal values in actual: NaN=1 Inf=0" in detail
    e_nan = e.clone()
    e_nan[5] = math.nan
    assert call(gate, a, e_nan)[0]
    assert call(error_distribution(), bad, e)[0]  # always_pass
    out = capsys.readouterr().out
    assert "rel-L2 = " in out and "diff_thd=1e-03  frac>thd=" in out and "|golden| percentiles: p50=" in out
    assert gate.__name__ == "error_distribution(diff_thds=(0.001, 0.003, 0.005, 0.01, 0.03, 0.05))"


def test_distribution_summary_figures_match_naive():
    a, e = t([1.0, 2.0, 0.0, -1.0]), t([1.0, 2.5, 0.002, -1.0])
    figures, lines = distribution_summary(a, e, diff_thds=(1e-3,), quantiles=(1.0,))
    assert figures["rel_l2"] == pytest.approx(math.sqrt(0.25 + 0.002**2) / math.sqrt(1 + 6.25 + 0.002**2 + 1))
    assert figures["frac_gt"]["0.001"] == 0.5  # 0.5/2.5 = 0.2 and 0.002 (abs, < 1) are bad
    assert figures["percentiles"]["abs_diff"]["p100"] == pytest.approx(0.5)
    assert lines[0].startswith("rel-L2 = ")


# -- our report figures ------------------------------------------------------------------------


def x_out_pair(ranks=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(ranks, 16, 4, 32, generator=g) * 2 - 1
    return e.clone(), e


def test_per_rank_attribution_names_the_bad_rank():
    a, e = x_out_pair(ranks=4)
    a[1].view(-1)[:400] += 0.01  # bad (abs error >= diff_thd below 1), never a sign flip to the cap
    v = ratio_reldiff(3e-3, 0.008, 1, rank_axis=True).evaluate(a, e)
    assert not v.passed and v.kind == "budget"
    assert [r.n_bad for r in v.per_rank] == [0, 400, 0, 0] and [r.numel for r in v.per_rank] == [2048] * 4
    assert v.figures["ranks_with_bad"] == [1] and v.figures["margin"] == 400 - round(0.008 * 8192)
    assert "rank 1: bad=400/2048" in v.detail
    assert v.per_rank[1].max_abs_diff_at[0] == 1 and v.figures["worst_at"][0] == 1
    # the verdict is the reference's (pooled): the rank split changes no number
    unranked = ratio_reldiff(3e-3, 0.008, 1).evaluate(a, e)
    assert unranked.passed == v.passed and unranked.figures["n_bad"] == 400 and len(unranked.per_rank) == 1
    assert unranked.detail.split("\n    worst rdiff=")[0] == v.detail.split("\n    worst rdiff=")[0]


def test_rank_permutation_hint():
    a, e = x_out_pair(ranks=3)
    a = e[[1, 0, 2]].clone()
    v = ratio_reldiff(3e-3, 0.008, 1, rank_axis=True).evaluate(a, e)
    assert not v.passed and v.figures["rank_permutation"] == {0: 1, 1: 0}
    assert [r.best_match_rank for r in v.per_rank] == [1, 0, None]
    assert "actual rank 0 matches expected rank 1" in v.detail
    v = ratio_allclose(1e-4, 1 / 128, rank_axis=True).evaluate(a, e)
    assert v.figures["rank_permutation"] == {0: 1, 1: 0}


def test_several_stray_rows_reported_with_sides():
    initial, e, m = ranked_pool(ranks=2, blocks=4, block_size=4, width=8, items=6)
    unmapped = [[row for row in range(16) if row not in m[r].tolist()] for r in range(2)]
    a = e.clone()
    flat_a, flat_e = a.view(2, 16, 8), e.view(2, 16, 8)
    flat_a[0, unmapped[0][0], 3] = 7.0  # implementation writes outside its mapping
    flat_a[1, unmapped[1][1]] = 0.0  # a zeroed page row
    flat_a[1, unmapped[1][2], 0] = 5.0
    flat_e[1, unmapped[1][4], :4] = -1.0  # the golden writes outside the mapping
    flat_a[0, int(m[0, 0])] = initial.view(2, 16, 8)[0, int(m[0, 0])]  # a skipped write
    cmp = build_comparator(PoolCheck("kv_cache", "m", 4, 1e-4, 1 / 128), mapping_shape=(2, 6), leading_rank_axis=True)
    v = cmp.evaluate(a, e, inputs={"m": m, initial_key("kv_cache"): initial})
    passed, strays, _ = naive_pool(a, e, m, 4, 1e-4, 1 / 128, 0.005)
    assert not v.passed and not passed and v.kind == "stray"
    assert v.figures["stray_rows"] == 4 and [r.stray_rows for r in v.per_rank] == [len(strays[0]), len(strays[1])]
    assert v.figures["stray_by_side"] == {"neither": 0, "actual": 3, "expected": 1, "both": 0}
    rank1 = v.per_rank[1].stray_examples
    assert [(x["row"], x["changed_side"]) for x in rank1] == sorted(
        [(unmapped[1][1], "actual"), (unmapped[1][2], "actual"), (unmapped[1][4], "expected")])
    ex = v.figures["stray_examples"][0]
    assert (ex["rank"], ex["block"], ex["intra"], ex["changed_values"]) == (
        0, unmapped[0][0] // 4, unmapped[0][0] % 4, 1)
    assert v.figures["unwritten_rows"] == 1 and [r.unwritten_rows for r in v.per_rank] == [1, 0]
    assert "4 unmapped row(s) changed in all (rank 0: 1, rank 1: 3)" in v.detail
    assert "(also failing)" in v.detail  # the skipped write also breaks the (zero) budget of 0.5 % of 80
    assert v.detail.splitlines()[0] == (f"    unmapped physical pool row changed: rank=0 row={unmapped[0][0]} "
                                        "changed_values=1 mapping='m'")


def test_pool_numeric_failure_locates_points():
    initial, e, m = ranked_pool()
    a = e.clone()
    rows = [int(x) for x in m[1, :3]]
    for row in rows:
        a.view(2, 16, 8)[1, row] += 1.0
    v = pool_cmp((2, 6), block_size=4, ranked=True, atol=1e-3).evaluate(a, e, inputs={"m": m})
    assert not v.passed and v.kind == "budget"
    assert v.detail.startswith("    mapped rows in pool from 'm':\n    ratio_allclose fail: error_count=24/80")
    passed, _, bad_by_rank = naive_pool(a, e, m, 4, 1e-3, 0.0, 0.0)
    assert [r.n_bad for r in v.per_rank] == [bad_by_rank[0], bad_by_rank[1]] == [0, 24]
    worst = v.figures["worst_bad"][0]
    assert worst["rank"] == 1 and worst["block"] * 4 + worst["intra"] in rows
    assert worst["item"] == m[1].tolist().index(worst["block"] * 4 + worst["intra"])
    assert tuple(worst["at"]) == (1, worst["block"], worst["intra"], 0, worst["col"])


def test_pool_matches_naive_on_random_damage():
    for seed in range(4):
        initial, e, m = ranked_pool(seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        a = e + (torch.rand(e.shape, generator=g) < 0.03) * 0.5
        for ratio in (0.0, 0.05, 0.3):
            v = pool_cmp((2, 6), block_size=4, ranked=True, atol=1e-3, rtol=1 / 128, max_error_ratio=ratio)
            v = v.evaluate(a, e, inputs={"m": m})
            passed, strays, bad_by_rank = naive_pool(a, e, m, 4, 1e-3, 1 / 128, ratio)
            assert v.passed == passed
            assert [r.stray_rows for r in v.per_rank] == [len(strays[0]), len(strays[1])]
            if not v.figures["stray_rows"]:
                assert [r.n_bad for r in v.per_rank] == [bad_by_rank[0], bad_by_rank[1]]


def test_int8_pool_skips_finiteness_and_compares_codes():
    e = torch.zeros(2, 2, 1, 4, dtype=torch.int8)
    a = e.clone()
    a[0, 0, 0] = torch.tensor([1, -1, 1, 2], dtype=torch.int8)
    cmp = pool_cmp((1,), atol=1.0, max_error_ratio=0.0)
    v = cmp.evaluate(a, e, inputs={"m": t([0], torch.int64)})
    assert not v.passed and v.figures["n_bad"] == 1 and "nonfinite_mapped_actual" not in v.figures


@pytest.mark.parametrize("make", [
    lambda: ratio_allclose(rank_axis=True), lambda: ratio_reldiff(rank_axis=True), lambda: exact(rank_axis=True),
    lambda: AllClose(1e-5, 1e-5, rank_axis=True),
])
def test_nan_in_actual_fails_with_counts_without_raising(make):
    a, e = x_out_pair()
    a[1, 2, 3, 4] = math.nan
    a[1, 0, 0, 0] = math.inf
    v = make().evaluate(a, e)
    assert not v.passed and isinstance(v, Verdict)
    assert (v.figures["nan_actual"], v.figures["inf_actual"], v.figures["nan_expected"]) == (1, 1, 0)
    assert [(r.nan_actual, r.inf_actual) for r in v.per_rank] == [(0, 0), (1, 1)]
    json.dumps(v.to_dict())


def test_nan_in_pool_and_distribution_do_not_raise():
    initial, e, m = ranked_pool()
    a = e.clone()
    a.view(2, 16, 8)[1, int(m[1, 0]), 0] = math.nan
    v = pool_cmp((2, 6), block_size=4, ranked=True).evaluate(a, e, inputs={"m": m})
    assert not v.passed and v.kind == "nonfinite" and v.figures["nonfinite_mapped_actual"] == 1
    assert [r.nan_actual for r in v.per_rank] == [0, 1]
    assert "illegal values in comparison: actual: NaN=1 Inf=0" in v.detail
    d = error_distribution(always_pass=False, rank_axis=True).evaluate(a.view(2, -1), e.view(2, -1))
    assert not d.passed and [r.n_bad for r in d.per_rank] == [0, 1]


@pytest.mark.parametrize("make", [
    lambda: ratio_allclose(), lambda: ratio_reldiff(), lambda: exact(), lambda: AllClose(),
    lambda: error_distribution(),
])
def test_shape_and_dtype_mismatch_fail_naming_both(make):
    v = make().evaluate(torch.zeros(2, 3), torch.zeros(3, 2))
    assert not v.passed and v.kind == "shape" and v.category == "contract"
    assert "actual=(2, 3) expected=(3, 2)" in v.detail
    v = make().evaluate(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16))
    assert not v.passed and "actual=torch.float32 expected=torch.bfloat16" in v.detail


def test_exact_is_elementwise_equality():
    x = t([1.0, -0.0, math.inf, 3.0])
    assert exact().evaluate(x, t([1.0, 0.0, math.inf, 3.0])).passed
    v = exact().evaluate(x, t([1.0, 0.0, math.inf, 3.5]))
    assert not v.passed and "exact fail: 1/4 elements differ" in v.detail and "[3] actual=3.0, expected=3.5" in v.detail
    assert exact().__name__ == "exact"
    ints = torch.arange(6).view(2, 3)
    other = ints.clone()
    other[1, 2] = -7
    v = exact(rank_axis=True).evaluate(other, ints)
    assert [r.n_bad for r in v.per_rank] == [0, 1] and v.figures["max_abs_diff"] == 12.0


def test_build_comparator_from_layer_checks():
    checks = (PoolCheck("kv_cache", "swa_slot_mapping", 32, 1e-4, 1 / 128, pool_name="KV cache"),
              RelDiffCheck("x_out", 3e-3, 0.008, 1))
    fns = build_compare_fn(checks, mapping_shape=(2, 16), leading_rank_axis=True)
    pool, x_out = fns["kv_cache"], fns["x_out"]
    assert isinstance(pool, Comparator) and pool.initial_name == "initial:kv_cache"
    assert pool.__name__ == ("mapped_pool_ratio_allclose(mapping=swa_slot_mapping, shape=(2, 16), block_size=32, "
                             "leading_rank_axis=True, atol=0.0001, rtol=0.0078125, max_error_ratio=0.005)")
    assert x_out.__name__ == ratio_reldiff(3e-3, 0.008, 1).__name__ and x_out.rank_axis
    with pytest.raises(TypeError):
        build_comparator("x_out", mapping_shape=(2, 16), leading_rank_axis=True)


def test_compare_outputs_returns_json_ready_verdicts():
    a, e = x_out_pair()
    a[0, 0, 0, 0] += 1
    verdicts = compare_outputs({"x_out": a, "other": t([1.0])}, {"x_out": e, "other": t([1.0])},
                               compare_fn={"x_out": ratio_reldiff(3e-3, 0.0, 1, rank_axis=True)})
    assert list(verdicts) == ["x_out", "other"]
    assert not verdicts["x_out"].passed and verdicts["other"].passed
    assert verdicts["other"].label == "allclose(rtol=1e-05, atol=1e-05)"
    d = json.loads(json.dumps(verdicts["x_out"].to_dict()))
    assert d["per_rank"][0]["n_bad"] == 1 and d["figures"]["worst_bad"][0]["at"] == [0, 0, 0, 0]


# -- FLASH dims --------------------------------------------------------------------------------


@pytest.mark.slow  # flash-size tensors
def test_flash_dims_compare_correctly():
    # x_out [P=8, t=64, HC=4, D=4096] fp32 (8.4M values) and a kv pool [8, 512, 32, 1, 512] bf16:
    # the comparators work at flash sizes (their speed is measured in scripts/bench.py, not here).
    g = torch.Generator().manual_seed(0)
    e = torch.randn(8, 64, 4, 4096, generator=g)
    a = e + torch.randn(e.shape, generator=g) * 1e-4
    x_cmp = ratio_reldiff(3e-3, 0.008, 1, rank_axis=True)
    v = x_cmp.evaluate(a, e)
    assert v.passed and v.figures["numel"] == e.numel()
    del a, e
    initial = torch.zeros(8, 512, 32, 1, 512, dtype=torch.bfloat16)
    m = torch.stack([torch.randperm(512 * 32, generator=g)[:64] for _ in range(8)])
    e = initial.clone()
    e.view(8, -1, 512).scatter_(1, m.unsqueeze(-1).expand(8, 64, 512), torch.randn(8, 64, 512, generator=g).bfloat16())
    a = e.clone()
    pool = build_comparator(PoolCheck("kv_cache", "m", 32, 1e-4, 1 / 128), mapping_shape=(8, 64), leading_rank_axis=True)
    inputs = {"m": m, initial_key("kv_cache"): initial}
    v = pool.evaluate(a, e, inputs=inputs)
    assert v.passed and v.figures["n_written_rows"] == 8 * 64
