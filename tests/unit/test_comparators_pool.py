"""Tests of launcher.verify's comparators: mapped_pool_ratio_allclose (§13.6).

Numeric rules are checked against the naive restatements of `tests.unit.comparator_helpers`.
"""

from __future__ import annotations

import math

import pytest
import torch

from launcher.verify import mapped_pool_ratio_allclose

from .comparator_helpers import CTX, t, pool_cmp, pool_call


# -- §13.6 mapped_pool_ratio_allclose ----------------------------------------------------------


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
