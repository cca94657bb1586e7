"""Integrity checks beside the reference comparators (launcher.verify.integrity): on plain
tensors, each check fails exactly the defect it names, where the reference budget passes it.
"""

from __future__ import annotations

import pytest
import torch

from launcher.verify import mapped_pool_ratio_allclose, ratio_reldiff
from launcher.verify.base import initial_key
from launcher.verify.integrity import golden_nonfinite, integrity_checks
from layers.contract.checks import PoolCheck, RelDiffCheck

BS, NB, W, T = 4, 8, 16, 12  # block size, blocks, row width, tokens per rank
KV = PoolCheck("kv_cache", mapping="slots", block_size=BS, atol=1e-4, rtol=1 / 128)
IDX = PoolCheck("idx_kv_cache", mapping="slots", block_size=BS, atol=1, rtol=0, max_error_ratio=0.01)
X_OUT = RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=2)


def _pool_case(dtype=torch.bfloat16):
    """Two ranks' pools before and after a correct step, and each rank's slot mapping."""
    g = torch.Generator().manual_seed(0)
    slots = torch.stack([torch.randperm(NB * BS, generator=g)[:T] for _ in range(2)])
    if dtype == torch.int8:
        before = torch.randint(-127, 128, (2, NB, BS, 1, W), generator=g, dtype=torch.int8)
        rows = torch.randint(-127, 128, (2, T, W), generator=g, dtype=torch.int8)
    else:
        before = torch.randn(2, NB, BS, 1, W, generator=g).to(dtype)
        rows = torch.randn(2, T, W, generator=g).to(dtype)
    golden = before.clone()
    for r in range(2):
        golden[r].view(-1, W)[slots[r]] = rows[r]
    return before, golden, slots


def _by_name(found):
    return {c.check: c for c in found}


def _judge(check, actual, golden, before, slots):
    inputs = {"slots": slots, initial_key(check.output): before}
    reference = mapped_pool_ratio_allclose("slots", mapping_shape=tuple(slots.shape), block_size=BS,
                                           leading_rank_axis=True, atol=check.atol, rtol=check.rtol,
                                           max_error_ratio=0.5, initial_name=initial_key(check.output))
    return reference.evaluate(actual, golden, inputs=inputs), _by_name(integrity_checks(check, actual, golden, inputs))


def test_a_correct_pool_passes_every_check():
    before, golden, slots = _pool_case()
    actual = golden.clone()
    actual.view(-1)[::7] = (actual.view(-1)[::7].float() * (1 + 1 / 256)).to(actual.dtype)  # one bf16 ulp
    _, found = _judge(KV, actual, golden, before, slots)
    assert list(found) == ["written_rows", "finite", "cap"]
    assert all(c.passed and not c.detail for c in found.values())
    assert found["written_rows"].figures["numel"] == 2 * T


def test_a_skipped_write_fails_written_rows_naming_rank_row_and_token():
    before, golden, slots = _pool_case()
    actual = golden.clone()
    actual[1].view(-1, W)[slots[1, 5]] = before[1].view(-1, W)[slots[1, 5]]
    verdict, found = _judge(KV, actual, golden, before, slots)
    assert verdict.passed  # inside the (here generous) pooled budget
    written = found["written_rows"]
    assert not written.passed and written.figures["n_bad"] == 1 and written.figures["per_rank"] == [0, 1]
    row = int(slots[1, 5])
    assert written.figures["examples"] == [{"rank": 1, "block": row // BS, "intra": row % BS, "row": row, "token": 5}]
    assert "1 unwritten row(s) (rank 1: 1)" == written.summary and "token=5" in written.detail


def test_one_absurd_value_fails_the_cap_only():
    before, golden, slots = _pool_case()
    actual = golden.clone()
    actual[0].view(-1, W)[slots[0, 3], 2] = 1e30
    verdict, found = _judge(KV, actual, golden, before, slots)
    assert verdict.passed
    assert found["written_rows"].passed and found["finite"].passed
    cap = found["cap"]
    assert not cap.passed and cap.figures["n_bad"] == 1 and cap.figures["per_rank"] == [1, 0]
    assert cap.figures["examples"][0]["token"] == 3 and cap.figures["examples"][0]["col"] == 2
    assert cap.figures["examples"][0]["diff"] == pytest.approx(1e30, rel=1e-2)


def test_the_cap_is_the_value_itself_plus_128_atol_for_a_bf16_cache():
    before, golden, slots = _pool_case(torch.float32)  # fp32 pool: the values are exact
    e = golden[0].view(-1, W)[slots[0, 0], 0].item()
    cap = 128 * 1e-4 + abs(e)
    for delta, passes in ((0.99 * cap, True), (1.01 * cap, False)):
        actual = golden.clone()
        actual[0].view(-1, W)[slots[0, 0], 0] = e + delta
        _, found = _judge(KV, actual, golden, before, slots)
        assert found["cap"].passed is passes, delta


def test_int8_cap_is_16_codes():
    before, golden, slots = _pool_case(torch.int8)
    golden[1].view(-1, W)[slots[1, 0], 0] = -100
    for delta, passes in ((16, True), (17, False)):
        actual = golden.clone()
        actual[1].view(-1, W)[slots[1, 0], 0] = -100 + delta
        _, found = _judge(IDX, actual, golden, before, slots)
        assert found["cap"].passed is passes, delta
        assert found["finite"].passed


def test_nonfinite_where_the_golden_is_finite_fails_finite():
    before, golden, slots = _pool_case()
    actual = golden.clone()
    actual[1].view(-1, W)[slots[1, 0], :3] = float("nan")
    _, found = _judge(KV, actual, golden, before, slots)
    assert not found["finite"].passed and found["finite"].figures["n_bad"] == 3
    assert found["cap"].passed  # non-finite values are the finite check's


def test_x_out_cap_catches_what_the_reference_cap_of_2_lets_through():
    g = torch.Generator().manual_seed(1)
    golden = torch.rand(2, 16, 4, 8, generator=g) * 2 - 1
    actual = golden.clone()
    actual[1, 3, 2, 5] = 1e30
    assert ratio_reldiff(3e-3, 0.008, 2).evaluate(actual, golden).passed  # rdiff 1 < 2, 1 point in budget
    found = _by_name(integrity_checks(X_OUT, actual, golden, {}))
    assert list(found) == ["finite", "cap"]
    assert not found["cap"].passed and found["cap"].figures["examples"][0]["at"] == (1, 3, 2, 5)
    actual[1, 3, 2, 5] = golden[1, 3, 2, 5] + 0.38  # inside 0.384 * max(1, |e|)
    assert _by_name(integrity_checks(X_OUT, actual, golden, {}))["cap"].passed


def test_golden_nonfinite_counts_mapped_rows_only():
    _, golden, slots = _pool_case(torch.float32)
    rank0 = golden[0].clone()
    unmapped = next(r for r in range(NB * BS) if r not in slots[0].tolist())
    rank0.view(-1, W)[unmapped] = float("-inf")  # a sentinel row the step never maps
    assert golden_nonfinite(KV, rank0, slots[0]) == 0
    rank0.view(-1, W)[slots[0, 4], :5] = float("nan")
    assert golden_nonfinite(KV, rank0, slots[0]) == 5
    assert golden_nonfinite(X_OUT, torch.full((4, 4), float("inf")), None) == 16
