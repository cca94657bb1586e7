"""Verification: one compared output (actual vs golden) -> a verdict (spec validation.md §6–§11),
where a failing output's errors are, and the first divergent stage of a failing layer.

Owns the reference-compatible comparator factories and `validate_golden`, with the reference's
pass rules, labels (`__name__`) and failure texts, plus structured figures for our report
(§14, §15). Pure tensor code on CPU: no torch.distributed, no layer code (only the check
dataclasses of `layers.contract.checks`, which `build_comparator` turns into comparators).

Modules, one comparator family each:
  base          Verdict, RankFigures, the Comparator base class and the figure helpers
  ratio         ratio_allclose (§8), ratio_reldiff (§10)
  pool          mapped_pool_ratio_allclose (§9)
  topk          topk_pair_compare (§11.1)
  distribution  error_distribution (§11.2)
  exact         exact, AllClose, and the scopes' SentinelExact / PrefixAndTail (§12.5)
  build         build_comparator (a layer's check -> its comparator), compare_outputs,
                validate_golden
  where         per-rank grids of where a failing output's bad points are (no drawing), and
                the figures a verdict's summary row shows (`tally`)
  integrity     the integrity checks beside the reference comparators (written rows, stale
                values, finite, a cap per tensor kind, concentration): what a pooled budget
                must never hide
  bisect        the first stage and rank where a failing full layer diverges
The comparators are re-exported here: `from launcher.verify import ratio_allclose`.

Every comparator is a small class:
  * `cmp(actual, expected, *, actual_outputs, expected_outputs, inputs, rtol, atol)` returns the
    reference's `(ok, detail)` (§6.1); `cmp.__name__` is the reference label.
  * `cmp.evaluate(...)` (same arguments) returns a `Verdict`: `passed`, `label`, `detail` (the
    reference text followed by our extra lines, empty on pass), `kind` (which check decided a
    failure), `category` ("contract" / "fixture" / "golden" / "implementation"), `figures`
    (pooled statistics), `per_rank` (one `RankFigures` per rank) and `notes` (informational
    lines, also on pass).

What differs from the reference, on purpose:
  * Shapes and dtypes are checked first and fail cleanly naming both sides (§14.9); the
    reference ratio comparators would broadcast or cast.
  * NaN / Inf never raise: they fail with per-side counts (and per-rank counts, first
    coordinates). With non-finite values present, `n_bad` / `max_abs_diff` count only the
    points that are finite on both sides.
  * Budgets stay pooled across ranks (identical verdicts), but `per_rank` names the ranks whose
    points are bad (§14.7). `rank_axis=True` makes the leading axis the rank axis (stacked
    `[P, ...]` outputs such as x_out); mapped pools use their `leading_rank_axis`.
  * The mapped-pool comparator reports every stray row (count per rank, first few as
    (rank, block, intra)), and when `inputs[initial_name]` holds the pool as it was before the
    step (`initial_key(output)` = "initial:<output>", what `build_comparator` wires), says
    which side changed each stray row and counts mapped rows the actual left unwritten.
  * `mapping_shape` is normalised to a tuple (the reference never matches a list).

Figure keys (all JSON-ready Python values):
  every comparator: shape, dtype (actual side); expected_shape / expected_dtype on mismatch.
  elementwise (ratio_allclose, ratio_reldiff, exact, allclose): numel, n_bad, max_abs_diff,
    max_abs_diff_at, worst, worst_at, nan_actual, inf_actual, nan_expected, inf_expected,
    ranks_with_bad, first_bad, worst_bad (lists of points {at, actual, expected, diff, tol |
    rdiff}); on a failing ranked tensor also rank_mean_abs_diff ([P][P]: actual rank r vs
    expected rank r') and rank_permutation ({r: r'} where r' matches r far better).
  ratio_allclose: atol, rtol (effective), max_error_ratio, threshold, margin, tol_at_max;
    worst = max diff/tol over bad points.
  ratio_reldiff: diff_thd, pct_thd, max_diff_hd, floor, threshold, margin, reasons
    (["budget"], ["cap"] or both); worst = worst_rdiff = max rdiff over bad points.
  mapped_pool_ratio_allclose: the ratio_allclose keys over the gathered mapped rows (points
    located as rank/block/intra/item/col, "item" = index in the rank's flattened mapping, i.e.
    the token, and "at" = coordinate in the pool), plus pool, mapping, row_width,
    rows_per_rank, n_written_rows, stray_rows, stray_examples (first few {rank, block, intra,
    row, changed_values[, changed_side]}), stray_by_side ({neither, actual, expected, both}
    or None without a snapshot), stray_nan ({actual, expected}), nonfinite_mapped_actual /
    nonfinite_mapped_expected (float pools), initial (True, False or why it was ignored),
    unwritten_rows (with a snapshot), first_duplicate / duplicate_rows (fixture errors).
  `worst` is +inf for a bad point whose tolerance is 0 (atol = rtol = 0).
  topk_pair_compare: numel, n_rows, k, n_mismatch (position-wise idx differences), n_bad
    (order-breaking mismatches), first_bad.
  error_distribution: numel, rel_l2, cosine, frac_gt, worst_by_thd, percentiles,
    golden_abs_mean, max_abs_diff, nan_actual, inf_actual, quantile_sample.
"""

from __future__ import annotations

from launcher.verify.base import Comparator, RankFigures, Verdict, initial_key
from launcher.verify.build import (
    build_comparator,
    build_compare_fn,
    build_stage_comparator,
    compare_outputs,
    validate_golden,
)
from launcher.verify.distribution import ErrorDistribution, distribution_summary, error_distribution
from launcher.verify.exact import AllClose, Exact, PrefixAndTail, SentinelExact, exact
from launcher.verify.pool import MappedPoolRatioAllclose, mapped_pool_ratio_allclose
from launcher.verify.ratio import RatioAllclose, RatioReldiff, ratio_allclose, ratio_reldiff
from launcher.verify.topk import TopkPairCompare, topk_pair_compare

__all__ = [
    "AllClose",
    "Comparator",
    "ErrorDistribution",
    "Exact",
    "MappedPoolRatioAllclose",
    "PrefixAndTail",
    "RankFigures",
    "RatioAllclose",
    "RatioReldiff",
    "SentinelExact",
    "TopkPairCompare",
    "Verdict",
    "build_comparator",
    "build_compare_fn",
    "build_stage_comparator",
    "compare_outputs",
    "distribution_summary",
    "error_distribution",
    "exact",
    "initial_key",
    "mapped_pool_ratio_allclose",
    "ratio_allclose",
    "ratio_reldiff",
    "topk_pair_compare",
    "validate_golden",
]
