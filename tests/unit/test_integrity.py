"""Integrity checks beside the reference comparators (launcher.verify.integrity): on plain
tensors, each check fails exactly the defect it names, where the reference budget passes it,
and passes what a correct implementation's rounding produces.
"""

from __future__ import annotations

import pytest
import torch

from launcher.verify import mapped_pool_ratio_allclose, ratio_reldiff
from launcher.verify.base import initial_key
from launcher.verify.integrity import golden_nonfinite, integrity_checks
from layers.contract.checks import HIDDEN_AXES, PoolCheck, RelDiffCheck

BS, NB, W, T = 4, 8, 16, 12  # block size, blocks, row width, tokens per rank
KV = PoolCheck("kv_cache", mapping="slots", block_size=BS, atol=1e-4, rtol=1 / 128)
IDX = PoolCheck("idx_kv_cache", mapping="slots", block_size=BS, atol=1, rtol=0, max_error_ratio=0.01)
X_OUT = RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=2, axes=HIDDEN_AXES)


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
    assert list(found) == ["written_rows", "stale_values", "finite", "cap"]
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
    assert list(found) == ["finite", "cap", "concentration"]
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


# -- stale_values ---------------------------------------------------------------------------------


def _stale(check, actual, golden, before, slots, with_initial=True):
    inputs = {"slots": slots, **({initial_key(check.output): before} if with_initial else {})}
    return _by_name(integrity_checks(check, actual, golden, inputs))["stale_values"]


def test_stale_values_fails_a_partly_written_row_and_stored_zeros_per_element():
    before, golden, slots = _pool_case()
    actual = golden.clone()
    rows = actual[1].view(-1, W)
    # Half a row never written; its old values within the cap of the new ones (half of them).
    before[1].view(-1, W)[slots[1, 2]] = golden[1].view(-1, W)[slots[1, 2]] * 0.5
    rows[slots[1, 2], W // 2:] = before[1].view(-1, W)[slots[1, 2], W // 2:]
    rows[slots[1, 7], -4:] = 0  # the last 4 columns stored as zeros
    verdict, found = _judge(KV, actual, golden, before, slots)
    assert verdict.passed and found["written_rows"].passed and found["cap"].passed  # what let these through
    stale = found["stale_values"]
    assert not stale.passed and stale.figures["per_rank"] == [0, stale.figures["n_bad"]]
    assert (stale.figures["kept"], stale.figures["zero"], stale.figures["rows"]) == (W // 2, 4, 2)
    first = stale.figures["examples"][0]
    assert (first["rank"], first["token"], first["col"]) == (1, 2, W // 2)
    assert first["actual"] == first["before"] != first["expected"]
    n = W // 2 + 4
    assert stale.summary == f"{n} stale value(s) in 2 row(s) (rank 1: {n}; {W // 2} as before the step, 4 zero)"


def test_stale_values_passes_rounding_to_the_old_value_and_legitimate_zeros():
    before, golden, slots = _pool_case(torch.float32)
    rows_g, rows_b = golden[0].view(-1, W), before[0].view(-1, W)
    row = slots[0, 3]
    rows_b[row] = rows_g[row] * (1 + 2**-9)  # the step moved these values by less than a tolerance
    rows_g[slots[0, 4], :3] = torch.tensor([0.0, 5e-5, -9e-5])  # zero, or within atol = 1e-4 of it
    actual = golden.clone()
    rows_a = actual[0].view(-1, W)
    rows_a[row] = rows_b[row]  # an implementation that rounded back to the old values: in tolerance
    rows_a[slots[0, 4], :3] = 0
    assert _stale(KV, actual, golden, before, slots).passed
    # Out of tolerance and equal to the old value by chance: rounding 2 tolerances off lands on
    # the old value (an old value near the new one); a kept value counts beyond 8 tolerances.
    e = float(rows_g[slots[0, 6], 0])
    for off, passes in ((2, True), (9, False)):
        rows_b[slots[0, 6], 0] = rows_a[slots[0, 6], 0] = e + off * (1e-4 + abs(e) / 128)
        assert _stale(KV, actual, golden, before, slots).passed is passes, off


def test_stale_values_int8_zero_is_a_code_within_one_of_the_golden():
    before, golden, slots = _pool_case(torch.int8)
    rows_g = golden[1].view(-1, W)
    rows_g[slots[1, 0], :2] = torch.tensor([1, -1], dtype=torch.int8)
    rows_g[slots[1, 0], 2] = 2
    actual = golden.clone()
    actual[1].view(-1, W)[slots[1, 0], :2] = 0  # one code off: a quantizer tie
    assert _stale(IDX, actual, golden, before, slots).passed
    actual[1].view(-1, W)[slots[1, 0], 2] = 0  # two codes off and 0: a stored zero
    stale = _stale(IDX, actual, golden, before, slots)
    assert not stale.passed and stale.figures["n_bad"] == 1 and stale.figures["examples"][0]["col"] == 2


def test_stale_values_without_the_old_pool_still_finds_zeros():
    before, golden, slots = _pool_case()
    actual = golden.clone()
    actual[0].view(-1, W)[slots[0, 1]] = before[0].view(-1, W)[slots[0, 1]]  # only the old pool tells this
    assert _stale(KV, actual, golden, before, slots, with_initial=False).passed
    actual[0].view(-1, W)[slots[0, 5]] = 0
    stale = _stale(KV, actual, golden, before, slots, with_initial=False)
    assert not stale.passed and stale.figures["initial"] is False and stale.figures["zero"] > W // 2
    assert "only the zeros were looked for" in stale.detail


# -- concentration --------------------------------------------------------------------------------

P, TOKENS, HC, D = 2, 64, 4, 64
X_NEXT = RelDiffCheck("x_next", diff_thd=3e-3, pct_thd=0.05, max_diff_hd=float("inf"), axes=HIDDEN_AXES)


def _x_case(noise_share: float, seed: int = 2):
    """A golden x_next, and an actual whose `noise_share` of the points, spread at random, are
    off by 1 % (bad by the reference rule)."""
    g = torch.Generator().manual_seed(seed)
    golden = torch.rand(P, TOKENS, HC, D, generator=g) + 0.5
    noisy = torch.rand(golden.shape, generator=g) < noise_share
    return golden * torch.where(noisy, 1.01, 1.0), golden


def _concentration(actual, golden):
    return _by_name(integrity_checks(X_NEXT, actual, golden, {}))["concentration"]


def test_noise_spread_over_the_tensor_passes_concentration_at_the_budget():
    actual, golden = _x_case(0.045)
    assert ratio_reldiff(3e-3, 0.05).evaluate(actual, golden).passed
    c = _concentration(actual, golden)
    assert c.passed and c.figures["tensor_fraction"] == pytest.approx(0.045, rel=0.05)
    assert set(c.figures["max_fraction"]) == {"rank", "token", "hc"} and c.figures["max_fraction"]["token"] < 0.25


def test_bad_points_concentrated_in_a_few_token_rows_fail_concentration_naming_rank_and_token():
    actual, golden = _x_case(0.005)
    actual[1, 3:6] = golden[1, 3:6] * 1.02  # three tokens of rank 1 wholly wrong by 2 %: a dropped route
    assert ratio_reldiff(3e-3, 0.05).evaluate(actual, golden).passed  # 3 rows of 128: inside 5 %
    c = _concentration(actual, golden)
    assert not c.passed and c.figures["per_rank"] == [0, 3]
    assert sorted(u["token"] for u in c.figures["examples"]) == [3, 4, 5]
    assert all(u["unit"] == "token" and u["rank"] == 1 and u["fraction"] == 1.0 for u in c.figures["examples"])
    assert "rank 1 token" in c.summary and "rank 1 token 3: 256/256 bad (100.0%)" in c.detail


def test_one_wrong_hc_stream_fails_concentration_naming_it():
    actual, golden = _x_case(0.0)
    actual[0, :, 2, :2] = golden[0, :, 2, :2] * 1.02  # stream 2 of rank 0: 2 of its 64 channels everywhere
    c = _concentration(actual, golden)
    assert ratio_reldiff(3e-3, 0.05).evaluate(actual, golden).passed
    assert c.passed  # 1/32 of the stream is bad: no unit far above the tensor
    actual[0, :, 2, :32] = golden[0, :, 2, :32] * 1.02  # half of the stream
    c = _concentration(actual, golden)
    assert not c.passed and [(u["unit"], u["rank"], u["hc"]) for u in c.figures["examples"]] == [("hc", 0, 2)]


def test_concentration_needs_a_floor_a_factor_and_a_minimum_count():
    # Floor: a quarter of a token row bad, with nothing else bad, fails; just under passes.
    actual, golden = _x_case(0.0)
    row = HC * D
    actual[0, 9].view(-1)[: row // 4] *= 1.02
    assert not _concentration(actual, golden).passed
    actual[0, 9].view(-1)[row // 4 - 1] = golden[0, 9].view(-1)[row // 4 - 1]
    assert _concentration(actual, golden).passed
    # Factor: a row at 30 % passes once the rest of the tensor's bad fraction is above 3 %.
    actual, golden = _x_case(0.035)
    actual[0, 9].view(-1)[: int(0.3 * row)] = golden[0, 9].view(-1)[: int(0.3 * row)] * 1.02
    c = _concentration(actual, golden)
    assert c.passed and c.figures["max_fraction"]["token"] >= 0.3
    # Minimum count: 7 bad points of a short row never fail, however concentrated.
    short = RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.05, max_diff_hd=float("inf"), axes=HIDDEN_AXES)
    golden = torch.ones(2, 64, 1, 7)
    actual = golden.clone()
    actual[1, 0] = 2.0
    assert _by_name(integrity_checks(short, actual, golden, {}))["concentration"].passed
    actual = torch.cat((actual, torch.full((2, 64, 1, 1), 1.0)), dim=3)
    actual[1, 0, 0, 7] = 2.0
    c = _by_name(integrity_checks(short, actual, torch.ones(2, 64, 1, 8), {}))["concentration"]
    assert not c.passed and c.figures["examples"][0]["token"] == 0


def test_a_diagnostic_tensor_has_no_concentration_check():
    """A run that makes x_out a measurement (reference_sim's CSA: top-k flips concentrate in
    tokens) keeps finite and cap, the gross errors, but not the budget's companion."""
    actual, golden = _x_case(0.0)
    actual[1, :4] = golden[1, :4] * 1.02
    assert not _concentration(actual, golden).passed
    found = _by_name(integrity_checks(X_NEXT, actual, golden, {}, diagnostic=True))
    assert list(found) == ["finite", "cap"]


def test_units_the_layer_says_may_concentrate_are_left_alone():
    """CSA's x_out: a top-k flip legitimately changes one token's row; its hc streams and ranks
    are still units."""
    csa_like = RelDiffCheck("x_next", diff_thd=3e-3, pct_thd=0.05, max_diff_hd=float("inf"),
                            concentrates_in=("token",), axes=HIDDEN_AXES)
    actual, golden = _x_case(0.0)
    actual[1, 5] = golden[1, 5] * 1.02
    assert not _concentration(actual, golden).passed
    c = _by_name(integrity_checks(csa_like, actual, golden, {}))["concentration"]
    assert c.passed and set(c.figures["max_fraction"]) == {"rank", "hc"}
    actual[0, :, 1, :32] = golden[0, :, 1, :32] * 1.02
    c = _by_name(integrity_checks(csa_like, actual, golden, {}))["concentration"]
    assert not c.passed and [(u["unit"], u["hc"]) for u in c.figures["examples"]] == [("hc", 1)]
