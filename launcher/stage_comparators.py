"""Comparators of the stage-level checks (`layers.contract.checks`, validation.md §12.5).

Owns the two comparators the reference composes for its standalone output-half tests and that
`launcher.comparators` does not have on its own:
  * `SentinelExact`: `exact` (allclose at rtol = atol = 0) plus, per rank, the padding rows an
    implementation wrote (rows the golden leaves all-sentinel) and the capacity-row poison values
    that reached the output (swa.md §9.2) — the two ways a collective writes or sends outside
    its valid rows.
  * `PrefixAndTail`: `hca_output_prefix_and_tail(local_t)` — the inactive tail must equal the
    golden's exactly, then `ratio_allclose` on the valid prefix.
and `build_stage_comparator`, which `launcher.comparators.build_comparator` calls for a
`StageCheck`. The allclose check maps onto `launcher.comparators.ratio_allclose` directly.
Pure tensor code, as `launcher.comparators`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from layers.contract.checks import AllcloseCheck, ExactCheck, PrefixTailCheck, StageCheck

from .comparators import MAX_EXAMPLES, Comparator, Exact, RatioAllclose, Verdict, ratio_allclose


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


def build_stage_comparator(check: StageCheck, *, leading_rank_axis: bool) -> Comparator:
    """The comparator of a stage-level check; `valid_axis` is shifted past the rank axis."""
    if isinstance(check, ExactCheck):
        return SentinelExact(check.sentinel, check.poison, rank_axis=leading_rank_axis)
    if isinstance(check, AllcloseCheck):
        return RatioAllclose(check.atol, check.rtol, check.max_error_ratio, valid_rows=check.valid_rows,
                             valid_axis=check.valid_axis + int(leading_rank_axis), zero_tail=check.zero_tail,
                             rank_axis=leading_rank_axis)
    if isinstance(check, PrefixTailCheck):
        return PrefixAndTail(check.valid_rows, check.atol, check.rtol, check.max_error_ratio, check.valid_axis,
                             rank_axis=leading_rank_axis)
    raise TypeError(f"no comparator for stage check {check!r}")


__all__ = ["SentinelExact", "PrefixAndTail", "build_stage_comparator"]
