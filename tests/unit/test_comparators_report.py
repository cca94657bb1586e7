"""Tests of launcher.verify's comparators: the extra cases of §13.10 and our report figures (per-rank
attribution, stray rows, NaN and shape handling, FLASH dims).

Numeric rules are checked against the naive restatements of `tests.unit.comparator_helpers`.
"""

from __future__ import annotations

import json
import math

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
)

from layers.contract.checks import PoolCheck, RelDiffCheck

from .comparator_helpers import call, t, naive_pool, pool_cmp


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
