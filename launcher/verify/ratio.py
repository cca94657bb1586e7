"""The two ratio gates of the reference: `ratio_allclose` (§8, bounded-outlier allclose) and
`ratio_reldiff` (§10, floored relative diff with a bad-point budget and a single-point cap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from launcher.verify.base import (
    Comparator,
    Judgement,
    Locate,
    Verdict,
    join_detail,
    listed_points,
    nonfinite_by_rank,
    nonfinite_lines,
    nonfinite_text,
    permutation_hint,
    plain_locator,
    point_figures,
    point_lines,
    pooled_note,
    pooled_totals,
    prepare,
    rank_bounds,
    rank_figures,
    rank_lines,
    sum_counts,
    unravel,
)


# -- ratio_allclose (§8) ----------------------------------------------------------------------


class RatioAllclose(Comparator):
    """Bounded-outlier allclose: pass iff #(|a-e| > atol + rtol*|e|) <= round(ratio * numel)."""

    def __init__(self, atol: float | None = None, rtol: float | None = None, max_error_ratio: float = 0.005,
                 max_show: int = 10, valid_rows: int | None = None, valid_axis: int = 0,
                 zero_tail: bool = False, *, rank_axis: bool = False):
        if max_error_ratio < 0.0 or max_error_ratio > 1.0:
            raise ValueError(f"max_error_ratio must be in [0, 1], got {max_error_ratio}")
        self.atol, self.rtol, self.max_error_ratio, self.max_show = atol, rtol, max_error_ratio, max_show
        self.valid_rows, self.valid_axis, self.zero_tail, self.rank_axis = valid_rows, valid_axis, zero_tail, rank_axis
        self.__name__ = (f"ratio_allclose(atol={atol}, rtol={rtol}, max_error_ratio={max_error_ratio}, "
                         f"valid_rows={valid_rows}, valid_axis={valid_axis}, zero_tail={zero_tail})")

    def effective(self, rtol: float, atol: float) -> tuple[float, float]:
        """(atol, rtol) after the call-time fallback for unset factory values."""
        return (atol if self.atol is None else self.atol), (rtol if self.rtol is None else self.rtol)

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        early, a, e, figures = prepare(self, actual, expected, self.valid_rows, self.valid_axis, self.zero_tail)
        if early:
            return early
        eff_atol, eff_rtol = self.effective(rtol, atol)
        j = self.judge(a, e, eff_atol, eff_rtol, rank_bounds(a, self.rank_axis), plain_locator(a.shape))
        figures.update(j.figures)
        extras = list(j.extras)
        if not j.passed:
            extras += rank_lines(j.per_rank)
            if self.rank_axis:
                extras += permutation_hint(a, e, j.per_rank, figures)
        return self._verdict(j.passed, j.kind, join_detail(j.reference, extras), figures, j.per_rank,
                             pooled_note(j.per_rank, j.passed))

    def judge(self, a: torch.Tensor, e: torch.Tensor, eff_atol: float, eff_rtol: float,
               bounds: Sequence[tuple[int, int]], locate: Locate, *, located: bool = False) -> Judgement:
        """§8.2 steps 5–9 on fp32 tensors whose leading axis is split per rank by `bounds`.

        `located`: the points' coordinates mean more than the flat index (pools), so the first
        mismatches are listed once more with them.
        """
        nonfinite = nonfinite_by_rank(a, e, bounds)
        counts = sum_counts(nonfinite)
        figures: dict[str, Any] = {"atol": eff_atol, "rtol": eff_rtol, "max_error_ratio": self.max_error_ratio,
                                   **counts}
        any_nonfinite = any(counts.values())
        diff = (a - e).abs()
        tol = eff_atol + eff_rtol * e.abs()
        bad = diff > tol
        if any_nonfinite:
            finite = torch.isfinite(a) & torch.isfinite(e)
            diff = torch.where(finite, diff, 0.0)
            bad &= finite
        n_bad = int(bad.sum())
        score = diff / tol if n_bad else None  # diff/tol of the bad points (inf where tol is 0)
        per_rank = rank_figures(bounds, nonfinite, diff, bad, score, locate)
        figures.update(pooled_totals(per_rank))
        numel = figures["numel"]
        threshold = round(self.max_error_ratio * numel)
        figures.update(threshold=threshold, margin=n_bad - threshold)
        if any_nonfinite:
            return Judgement(False, "nonfinite", nonfinite_text(counts), nonfinite_lines(a, e, locate),
                              figures, per_rank)
        flat_max = int(diff.view(-1).argmax())
        figures["tol_at_max"] = float(tol.view(-1)[flat_max])
        first, worst = listed_points(bad, score, self.max_show)
        figures["worst_at"] = tuple(locate(worst[0])["at"]) if worst else None
        figures["first_bad"] = point_figures(first, a, e, diff, locate, "tol", tol)
        figures["worst_bad"] = point_figures(worst, a, e, diff, locate, "tol", tol)
        if n_bad <= threshold:
            return Judgement(True, None, "", [], figures, per_rank)
        lines = [f"    [{p['flat']}] actual={p['actual']:.8g}, expected={p['expected']:.8g}, "
                 f"diff={p['diff']:.4g}, tol={p['tol']:.4g}" for p in figures["first_bad"]]
        reference = (
            f"    ratio_allclose fail: error_count={n_bad}/{numel} "
            f"(ratio={n_bad / numel:.4%}, allowed<={self.max_error_ratio:.4%}, threshold={threshold} pts)\n"
            f"    atol={eff_atol} rtol={eff_rtol}\n"
            f"    max abs diff={float(diff.view(-1)[flat_max]):.6g} at {unravel(flat_max, a.shape)} "
            f"(tol={figures['tol_at_max']:.6g})\n"
            f"    first {len(lines)} mismatches:\n" + "\n".join(lines)
        )
        extras = [f"    margin: {n_bad - threshold} pts over the budget"]
        if located:
            extras += point_lines(f"first {len(first)} mismatches located", figures["first_bad"], "tol")
        extras += point_lines(f"worst {len(worst)} mismatches (by diff/tol)", figures["worst_bad"], "tol")
        return Judgement(False, "budget", reference, extras, figures, per_rank)


def ratio_allclose(atol: float | None = None, rtol: float | None = None, max_error_ratio: float = 0.005,
                   max_show: int = 10, valid_rows: int | None = None, valid_axis: int = 0,
                   zero_tail: bool = False, *, rank_axis: bool = False) -> RatioAllclose:
    return RatioAllclose(atol, rtol, max_error_ratio, max_show, valid_rows, valid_axis, zero_tail,
                         rank_axis=rank_axis)


# -- ratio_reldiff (§10) ----------------------------------------------------------------------


class RatioReldiff(Comparator):
    """Floored relative diff with a bad-point budget and a strict single-point cap (§10.2)."""

    def __init__(self, diff_thd: float = 0.01, pct_thd: float = 0.05, max_diff_hd: float = float("inf"),
                 max_show: int = 10, valid_rows: int | None = None, valid_axis: int = 0,
                 zero_tail: bool = False, *, rank_axis: bool = False):
        if not 0.0 < diff_thd:
            raise ValueError(f"diff_thd must be > 0, got {diff_thd}")
        if not 0.0 <= pct_thd <= 1.0:
            raise ValueError(f"pct_thd must be in [0, 1], got {pct_thd}")
        if not 0.0 < max_diff_hd:
            raise ValueError(f"max_diff_hd must be > 0, got {max_diff_hd}")
        self.diff_thd, self.pct_thd, self.max_diff_hd, self.max_show = diff_thd, pct_thd, max_diff_hd, max_show
        self.valid_rows, self.valid_axis, self.zero_tail, self.rank_axis = valid_rows, valid_axis, zero_tail, rank_axis
        self.floor = (1.0 / (1 << 14)) / diff_thd
        self.__name__ = (f"ratio_reldiff(diff_thd={diff_thd}, pct_thd={pct_thd}, max_diff_hd={max_diff_hd}, "
                         f"valid_rows={valid_rows}, valid_axis={valid_axis}, zero_tail={zero_tail})")

    def rdiff(self, a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(|a - e|, rdiff) of §10.2 on fp32 tensors.

        The steps literally (same ops, fp32 tensors, Python-float scalars): the boundaries of
        `diff < diff_thd`, the floor and the +1e-9 depend on them bit for bit.
        """
        diff = (a - e).abs()
        denom = torch.maximum(a.abs(), e.abs()).clamp_min(self.floor) + 1e-9
        return diff, torch.where(diff < self.diff_thd, diff, diff / denom)

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        early, a, e, figures = prepare(self, actual, expected, self.valid_rows, self.valid_axis, self.zero_tail)
        if early:
            return early
        bounds, locate = rank_bounds(a, self.rank_axis), plain_locator(a.shape)
        nonfinite = nonfinite_by_rank(a, e, bounds)
        counts = sum_counts(nonfinite)
        figures.update(diff_thd=self.diff_thd, pct_thd=self.pct_thd, max_diff_hd=self.max_diff_hd,
                       floor=self.floor, **counts)
        any_nonfinite = any(counts.values())
        diff, rdiff = self.rdiff(a, e)
        bad = rdiff > self.diff_thd
        if any_nonfinite:
            finite = torch.isfinite(a) & torch.isfinite(e)
            diff = torch.where(finite, diff, 0.0)
            bad &= finite
        per_rank = rank_figures(bounds, nonfinite, diff, bad, rdiff, locate)
        figures.update(pooled_totals(per_rank))
        n_bad, numel = figures["n_bad"], figures["numel"]
        threshold = round(self.pct_thd * numel)
        worst_rdiff = figures["worst"] if n_bad else 0.0
        figures.update(threshold=threshold, margin=n_bad - threshold, worst_rdiff=worst_rdiff)
        if any_nonfinite:
            extras = nonfinite_lines(a, e, locate) + rank_lines(per_rank)
            return self._verdict(False, "nonfinite", join_detail(nonfinite_text(counts), extras), figures, per_rank)
        first, worst = listed_points(bad, rdiff, self.max_show)
        figures["worst_at"] = tuple(locate(worst[0])["at"]) if worst else None
        figures["first_bad"] = point_figures(first, a, e, diff, locate, "rdiff", rdiff)
        figures["worst_bad"] = point_figures(worst, a, e, diff, locate, "rdiff", rdiff)
        reasons = (["budget"] if n_bad > threshold else []) + (["cap"] if worst_rdiff >= self.max_diff_hd else [])
        figures["reasons"] = reasons
        if not reasons:
            return self._verdict(True, None, "", figures, per_rank, pooled_note(per_rank, True))
        texts = []
        if "budget" in reasons:
            texts.append(f"error_count={n_bad}/{numel} (ratio={n_bad / numel:.4%}, "
                         f"allowed<={self.pct_thd:.4%}, threshold={threshold} pts)")
        if "cap" in reasons:
            texts.append(f"worst rdiff={worst_rdiff:.4g} >= max_diff_hd={self.max_diff_hd:.4g}")
        lines = [f"    [{p['flat']}] actual={p['actual']:.8g}, expected={p['expected']:.8g}, "
                 f"abs_diff={p['diff']:.4g}, rdiff={p['rdiff']:.4g}" for p in figures["first_bad"]]
        reference = (
            f"    ratio_reldiff fail: {' AND '.join(texts)}\n"
            f"    diff_thd={self.diff_thd} pct_thd={self.pct_thd} max_diff_hd={self.max_diff_hd}\n"
            f"    first {len(lines)} mismatches:\n" + "\n".join(lines)
        )
        extras = [f"    worst rdiff={worst_rdiff:.6g} at {figures['worst_at']} (cap {self.max_diff_hd}); "
                  f"floor={self.floor:.6g}; {n_bad}/{numel} bad vs threshold {threshold} "
                  f"(margin {n_bad - threshold:+d} pts)"]
        extras += point_lines(f"worst {len(worst)} mismatches (by rdiff)", figures["worst_bad"], "rdiff")
        extras += rank_lines(per_rank)
        if self.rank_axis:
            extras += permutation_hint(a, e, per_rank, figures)
        kind = "budget+cap" if len(reasons) == 2 else reasons[0]
        return self._verdict(False, kind, join_detail(reference, extras), figures, per_rank)


def ratio_reldiff(diff_thd: float = 0.01, pct_thd: float = 0.05, max_diff_hd: float = float("inf"),
                  max_show: int = 10, valid_rows: int | None = None, valid_axis: int = 0,
                  zero_tail: bool = False, *, rank_axis: bool = False) -> RatioReldiff:
    return RatioReldiff(diff_thd, pct_thd, max_diff_hd, max_show, valid_rows, valid_axis, zero_tail,
                        rank_axis=rank_axis)


