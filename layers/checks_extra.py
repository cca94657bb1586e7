"""Stage-level checks (as data) for the focused scopes and for bisect (validation.md §12.5).

The layer checks of `layers.base` judge a whole decode step (pools, x_out); these judge one
stage of it: a collective's bitwise data movement with its sentinel and poison values, the
sharded projection's valid prefix with an exactly-zero tail, the output half's valid prefix
with an untouched sentinel tail, and a stage's output given the same inputs as the golden's.
`launcher.stage_comparators` turns them into comparators; `launcher.comparators.build_comparator`
dispatches to it.

Axes are per rank: the leading rank axis of the stacked `[P, ...]` tensors the worker compares
is not counted in `valid_axis` (the comparator adds it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCheck:
    output: str


@dataclass(frozen=True)
class ExactCheck(StageCheck):
    """Every element equal (the reference's allclose at rtol = atol = 0, swa.md §8).

    `sentinel`: the value every row outside the valid destinations holds before and after the
    step; an actual row that the golden leaves all-sentinel but that differs is counted as a
    touched padding row. `poison`: values the inputs' capacity rows hold, which must never
    reach an output (swa.md §9.2).
    """

    sentinel: float | None = None
    poison: tuple[float, ...] = ()


@dataclass(frozen=True)
class AllcloseCheck(StageCheck):
    """`ratio_allclose(atol, rtol, max_error_ratio, valid_rows, valid_axis, zero_tail)` (validation.md §8)."""

    atol: float
    rtol: float
    max_error_ratio: float = 0.005
    valid_rows: int | None = None
    valid_axis: int = 0
    zero_tail: bool = False


@dataclass(frozen=True)
class PrefixTailCheck(StageCheck):
    """`hca_output_prefix_and_tail(local_t)` (validation.md §12.5): the rows past `valid_rows`
    must equal the golden's exactly (the sentinel survives), then `ratio_allclose` on the prefix.

    The reference's HCA form uses max_error_ratio 0.005; the swa.md §9.4 output-half design
    uses 0 (every valid element within tolerance).
    """

    valid_rows: int
    atol: float = 1e-4
    rtol: float = 1 / 128
    max_error_ratio: float = 0.005
    valid_axis: int = 0


__all__ = ["StageCheck", "ExactCheck", "AllcloseCheck", "PrefixTailCheck"]
