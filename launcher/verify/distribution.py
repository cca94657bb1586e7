"""`error_distribution` (§11.2): a measurement (rel-L2, cosine, fraction over thresholds,
percentiles) that gates nothing but, if asked, NaN/Inf in the actual tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from launcher.verify.base import Comparator, RankFigures, Verdict, base_figures, mismatch_verdict, rank_bounds

QUANTILE_MAX = 1 << 24  # torch.quantile refuses larger inputs (§14.16)


# -- error_distribution (§11.2) ----------------------------------------------------------------


def distribution_summary(actual: torch.Tensor, expected: torch.Tensor,
                         diff_thds: Sequence[float] = (1e-3, 3e-3, 5e-3, 1e-2, 3e-2, 5e-2),
                         quantiles: Sequence[float] = (0.5, 0.9, 0.99, 0.999, 0.9999, 1.0)
                         ) -> tuple[dict[str, Any], list[str]]:
    """The error_distribution measurement (rel-L2, cosine, frac>thd, percentiles) without printing.

    Returns `(figures, lines)`; the lines are the reference's printout. Inputs above 2^24 finite
    values are subsampled with a fixed stride for the percentiles (torch.quantile's limit).
    """
    a = actual.cpu().to(torch.float32).reshape(-1)
    e = expected.cpu().to(torch.float32).reshape(-1)
    diff = (a - e).abs()
    rel = float(diff.norm() / e.norm().clamp_min(1e-12))
    cos = float(torch.nn.functional.cosine_similarity(a, e, dim=0)) if a.numel() else float("nan")
    figures: dict[str, Any] = {"numel": a.numel(), "rel_l2": rel, "cosine": cos, "frac_gt": {}, "worst_by_thd": {},
                               "percentiles": {}, "quantile_sample": None,
                               "max_abs_diff": float(diff.max()) if a.numel() else None}
    lines = [f"rel-L2 = {rel:.4%}  cosine = {cos:.7f}  numel={a.numel()}"]
    for thd in diff_thds:
        # the ratio_reldiff rule at this threshold (floor 2^-14 / thd, +1e-9)
        denom = torch.maximum(a.abs(), e.abs()).clamp_min((1.0 / (1 << 14)) / thd) + 1e-9
        rdiff = torch.where(diff < thd, diff, diff / denom)
        bad = rdiff > thd
        n = int(bad.sum())
        worst = float(rdiff[bad].max()) if n else 0.0
        frac = n / max(a.numel(), 1)
        figures["frac_gt"][str(thd)], figures["worst_by_thd"][str(thd)] = frac, worst
        lines.append(f"  diff_thd={thd:.0e}  frac>thd={frac:.4%}  worst={worst:.3g}")
    qs = torch.tensor(list(quantiles), dtype=torch.float32)

    def pct(key: str, label: str, flat: torch.Tensor) -> None:
        flat = flat[torch.isfinite(flat)]
        if flat.numel() == 0:
            lines.append(f"  {label}: (no finite values)")
            figures["percentiles"][key] = None
            return
        if flat.numel() > QUANTILE_MAX:
            flat = flat[:: math.ceil(flat.numel() / QUANTILE_MAX)]
            figures["quantile_sample"] = flat.numel()
        values = torch.quantile(flat, qs).tolist()
        figures["percentiles"][key] = {f"p{q * 100:g}": v for q, v in zip(quantiles, values)}
        lines.append(f"  {label}: " + "  ".join(f"p{q * 100:g}={v:.3g}" for q, v in zip(quantiles, values)))

    pct("rel_diff", "rel-diff percentiles", diff / torch.maximum(a.abs(), e.abs()).clamp_min(1e-6))
    pct("abs_diff", "abs-diff percentiles", diff)
    golden_abs = e.abs()
    figures["golden_abs_mean"] = float(golden_abs.mean()) if a.numel() else None
    lines.append(f"  |golden| mean={golden_abs.mean():.4g}")
    pct("golden_abs", "|golden| percentiles", golden_abs)
    return figures, lines


class ErrorDistribution(Comparator):
    """A measurement, printed to stdout; it only gates NaN/Inf in actual, and only if asked."""

    def __init__(self, diff_thds: Sequence[float] = (1e-3, 3e-3, 5e-3, 1e-2, 3e-2, 5e-2),
                 quantiles: Sequence[float] = (0.5, 0.9, 0.99, 0.999, 0.9999, 1.0), always_pass: bool = True,
                 *, rank_axis: bool = False):
        self.diff_thds, self.quantiles, self.always_pass, self.rank_axis = (
            tuple(diff_thds), tuple(quantiles), always_pass, rank_axis)
        self.__name__ = f"error_distribution(diff_thds={self.diff_thds})"

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        mismatch = mismatch_verdict(self, actual, expected)
        if mismatch:
            return mismatch
        a, e = actual.cpu().to(torch.float32), expected.cpu().to(torch.float32)
        a, e = a.reshape(a.shape or (1,)), e.reshape(e.shape or (1,))
        nan, inf = int(torch.isnan(a).sum()), int(torch.isinf(a).sum())
        illegal = f"    illegal values in actual: NaN={nan} Inf={inf}" if nan or inf else ""
        summary, lines = distribution_summary(a, e, self.diff_thds, self.quantiles)
        notes = [illegal, *lines] if illegal else lines
        for line in notes:
            print(line)
        figures = {**base_figures(actual), **summary, "nan_actual": nan, "inf_actual": inf}
        per_rank = []
        for r, (s, stop) in enumerate(rank_bounds(a, self.rank_axis)):  # one summary per rank (a handful)
            rank_summary, _ = distribution_summary(a[s:stop], e[s:stop], self.diff_thds, self.quantiles)
            a_r = a[s:stop]
            per_rank.append(RankFigures(
                rank=r, numel=a_r.numel(), n_bad=int((~torch.isfinite(a_r)).sum()),
                max_abs_diff=rank_summary["max_abs_diff"], nan_actual=int(torch.isnan(a_r).sum()),
                inf_actual=int(torch.isinf(a_r).sum()), distribution=rank_summary))
        passed = self.always_pass or not (nan or inf)
        return self._verdict(passed, "nonfinite", illegal, figures, per_rank, notes)


def error_distribution(diff_thds: Sequence[float] = (1e-3, 3e-3, 5e-3, 1e-2, 3e-2, 5e-2),
                       quantiles: Sequence[float] = (0.5, 0.9, 0.99, 0.999, 0.9999, 1.0),
                       always_pass: bool = True, *, rank_axis: bool = False) -> ErrorDistribution:
    return ErrorDistribution(diff_thds, quantiles, always_pass, rank_axis=rank_axis)


