"""Tests of launcher.verify's comparators: topk_pair_compare (§13.7).

Numeric rules are checked against the naive restatements of `tests.unit.comparator_helpers`.
"""

from __future__ import annotations

import math

import torch

from launcher.verify import topk_pair_compare, validate_golden

from .comparator_helpers import t, topk


# -- §13.7 topk_pair_compare -------------------------------------------------------------------


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
