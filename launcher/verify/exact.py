"""Element-for-element comparators: `exact` (every element equal, the collectives' check),
`AllClose` (the default of validate_golden), and the two the reference composes for its
standalone output-half tests (validation.md §12.5):
  * `SentinelExact`: `exact` plus, per rank, the padding rows an implementation wrote (rows the
    golden leaves all-sentinel) and the capacity-row poison values that reached the output
    (swa.md §9.2) — the two ways a collective writes or sends outside its valid rows.
  * `PrefixAndTail`: `hca_output_prefix_and_tail(local_t)` — the inactive tail must equal the
    golden's exactly, then `ratio_allclose` on the valid prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from launcher.verify.base import (
    MAX_EXAMPLES,
    Comparator,
    Verdict,
    base_figures,
    join_detail,
    listed_points,
    mismatch_verdict,
    nonfinite_by_rank,
    permutation_hint,
    plain_locator,
    point_figures,
    pooled_totals,
    rank_bounds,
    rank_figures,
    rank_lines,
    sum_counts,
)
from launcher.verify.ratio import ratio_allclose


# -- exact and the default allclose ------------------------------------------------------------


class _MaskComparator(Comparator):
    """Comparators whose bad points are a mask (exact, allclose); figures in fp64."""

    max_show: int
    rank_axis: bool

    def _mask_verdict(self, a: torch.Tensor, e: torch.Tensor, bad: torch.Tensor, reference: Callable[[list], str],
                      figures: dict[str, Any]) -> Verdict:
        a64 = a.to(torch.float64).reshape(a.shape or (1,))
        e64 = e.to(torch.float64).reshape(a.shape or (1,))
        bad = bad.reshape(a.shape or (1,))
        bounds, locate = rank_bounds(a64, self.rank_axis), plain_locator(a64.shape)
        nonfinite = nonfinite_by_rank(a64, e64, bounds)
        finite = torch.isfinite(a64) & torch.isfinite(e64)
        diff = torch.where(finite, (a64 - e64).abs(), 0.0)
        per_rank = rank_figures(bounds, nonfinite, diff, bad, diff, locate)
        figures.update(sum_counts(nonfinite), **pooled_totals(per_rank))
        n_bad = figures["n_bad"]
        first, _ = listed_points(bad, None, self.max_show)
        figures["first_bad"] = point_figures(first, a64, e64, diff, locate)
        if not n_bad:
            return self._verdict(True, None, "", figures, per_rank)
        extras = rank_lines(per_rank)
        if self.rank_axis:
            extras += permutation_hint(a64, e64, per_rank, figures)
        flat_a, flat_e = a.reshape(-1), e.reshape(-1)
        shown = [(i, flat_a[i].item(), flat_e[i].item()) for i in first]
        return self._verdict(False, "mismatch", join_detail(reference(shown), extras), figures, per_rank)


class Exact(_MaskComparator):
    """Every element equal (`==`): the reference's allclose(rtol=0, atol=0) for collectives.

    NaN never equals NaN (poison must not appear), equal infinities and ±0 compare equal.
    """

    def __init__(self, *, max_show: int = 20, rank_axis: bool = False):
        self.max_show, self.rank_axis = max_show, rank_axis
        self.__name__ = "exact"

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        mismatch = mismatch_verdict(self, actual, expected)
        if mismatch:
            return mismatch
        a, e = actual.cpu(), expected.cpu()
        figures = base_figures(actual)
        if a.numel() == 0:
            return self._verdict(True, None, "", {**figures, "numel": 0, "n_bad": 0})
        bad = a != e

        def reference(shown: list) -> str:
            lines = [f"    [{i}] actual={x}, expected={y}" for i, x, y in shown]
            return (f"    exact fail: {int(bad.sum())}/{a.numel()} elements differ (NaN never equal)\n"
                    f"    first {len(lines)} mismatches:\n" + "\n".join(lines))

        return self._mask_verdict(a, e, bad, reference, figures)


def exact(*, max_show: int = 20, rank_axis: bool = False) -> Exact:
    return Exact(max_show=max_show, rank_axis=rank_axis)


class AllClose(_MaskComparator):
    """The default of validate_golden: torch.allclose (|a-e| <= atol + rtol*|e|, NaN never equal).

    `rtol`/`atol` None take the call-time values. Unlike the reference, a shape or dtype mismatch
    is a clean FAIL instead of broadcasting or raising.
    """

    def __init__(self, rtol: float | None = None, atol: float | None = None, *, max_show: int = 20,
                 rank_axis: bool = False):
        self.rtol, self.atol, self.max_show, self.rank_axis = rtol, atol, max_show, rank_axis
        self.__name__ = f"allclose(rtol={rtol}, atol={atol})"

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        mismatch = mismatch_verdict(self, actual, expected)
        if mismatch:
            return mismatch
        eff_rtol = rtol if self.rtol is None else self.rtol
        eff_atol = atol if self.atol is None else self.atol
        a, e = actual.cpu(), expected.cpu()
        figures = {**base_figures(actual), "rtol": eff_rtol, "atol": eff_atol}
        if a.numel() == 0:
            return self._verdict(True, None, "", {**figures, "numel": 0, "n_bad": 0})
        bad = ~torch.isclose(a, e, rtol=eff_rtol, atol=eff_atol)

        def reference(shown: list) -> str:
            lines = [f"    [{i}] actual={x}, expected={y}" for i, x, y in shown]
            return (f"    Mismatched elements: {int(bad.sum())}/{a.numel()}  rtol={eff_rtol} atol={eff_atol}\n"
                    f"    first {len(lines)} mismatches:\n" + "\n".join(lines))

        return self._mask_verdict(a, e, bad, reference, figures)



# -- the stage-level checks of the focused scopes (§12.5) -------------------------------------


def _per_rank_rows(t: torch.Tensor, rank_axis: bool) -> torch.Tensor:
    """[P, rows, width] view of a tensor whose last axis is the row width (P = 1 unranked)."""
    lead = t.shape[0] if rank_axis and t.dim() else 1
    return t.reshape(lead, -1, t.shape[-1] if t.dim() else 1)


class SentinelExact(Comparator):
    """`exact`, naming the padding rows written and the poison values that reached the output."""

    def __init__(self, sentinel: float | None = None, poison: tuple[float, ...] = (), *, rank_axis: bool = False):
        self.sentinel, self.poison, self.rank_axis = sentinel, tuple(poison), rank_axis
        self._exact = Exact(rank_axis=rank_axis)
        self.__name__ = self._exact.__name__

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        v = self._exact.evaluate(actual, expected)
        if v.kind in ("shape", "dtype") or actual.numel() == 0:
            return v
        a = _per_rank_rows(actual.cpu(), self.rank_axis)
        e = _per_rank_rows(expected.cpu(), self.rank_axis)
        figures: dict[str, Any] = {}
        lines = []
        if self.sentinel is not None:
            padding = (e == self.sentinel).all(dim=-1)  # [P, rows]: rows no valid destination reaches
            touched = padding & (a != e).any(dim=-1)
            by_rank = touched.sum(dim=1).tolist()
            first = touched.nonzero()[:MAX_EXAMPLES].tolist()
            figures.update(padding_rows=int(padding.sum()), touched_padding_rows=int(touched.sum()),
                           touched_padding_by_rank=by_rank,
                           first_touched_padding=[{"rank": r, "row": i} for r, i in first])
            if figures["touched_padding_rows"]:
                ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(by_rank) if n)
                rows = ", ".join(f"(rank {r}, row {i})" for r, i in first)
                lines.append(f"    padding rows written (sentinel {self.sentinel} overwritten): "
                             f"{figures['touched_padding_rows']} ({ranks}); first {rows}")
        if self.poison:
            hit = torch.isin(a, torch.tensor(self.poison, dtype=a.dtype))
            by_rank = hit.flatten(1).sum(dim=1).tolist()
            figures.update(poison_values=int(hit.sum()), poison_by_rank=by_rank)
            if figures["poison_values"]:
                ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(by_rank) if n)
                lines.append(f"    capacity-row poison {self.poison} in the output: {figures['poison_values']} "
                             f"values ({ranks}): rows past local_t were sent or read")
        detail = "\n".join([v.detail, *lines]) if lines and not v.passed else v.detail
        return dataclasses.replace(v, detail=detail, figures={**v.figures, **figures})


class PrefixAndTail(Comparator):
    """The inactive tail exactly as the golden's, then ratio_allclose on the valid prefix."""

    def __init__(self, valid_rows: int, atol: float = 1e-4, rtol: float = 1 / 128, max_error_ratio: float = 0.005,
                 valid_axis: int = 0, *, rank_axis: bool = False):
        self.valid_rows, self.rank_axis = valid_rows, rank_axis
        self.axis = valid_axis + int(rank_axis)
        self._prefix = ratio_allclose(atol, rtol, max_error_ratio, valid_rows=valid_rows, valid_axis=self.axis,
                                      rank_axis=rank_axis)
        self.__name__ = (f"hca_output_prefix_and_tail(local_t={valid_rows})" if max_error_ratio == 0.005 else
                         f"output_prefix_and_tail(local_t={valid_rows}, max_error_ratio={max_error_ratio})")

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        shaped = actual.shape == expected.shape and actual.dtype == expected.dtype
        if not shaped or not 0 <= self.valid_rows <= actual.shape[self.axis]:
            v = self._prefix.evaluate(actual, expected, rtol=rtol, atol=atol)
            return dataclasses.replace(v, label=self.__name__)
        a, e = actual.cpu(), expected.cpu()
        n_tail = a.shape[self.axis] - self.valid_rows
        bad = a.narrow(self.axis, self.valid_rows, n_tail) != e.narrow(self.axis, self.valid_rows, n_tail)
        count = int(bad.sum())
        by_rank = bad.flatten(1).sum(dim=1).tolist() if self.rank_axis and bad.dim() > 1 else [count]
        tail = {"tail_rows": n_tail, "tail_mismatch": count, "tail_mismatch_by_rank": by_rank}
        if count:
            ranks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(by_rank) if n)
            detail = f"    inactive token tail mismatch count={count}\n    per rank: {ranks}"
            figures = {"shape": list(actual.shape), "dtype": str(actual.dtype), **tail}
            return Verdict(passed=False, label=self.__name__, detail=detail, kind="tail", category="implementation",
                           figures=figures)
        v = self._prefix.evaluate(a, e, rtol=rtol, atol=atol)
        return dataclasses.replace(v, label=self.__name__, figures={**v.figures, **tail})
