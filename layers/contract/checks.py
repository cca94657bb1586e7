"""The checks a compared tensor is judged by, as data (the launcher builds the comparators).

Layer checks judge a whole decode step: a cache/state pool only where the step wrote
(`PoolCheck`, validation.md §9) and x_out by a floored relative difference with a bad-point
budget (`RelDiffCheck`, §10). Stage checks judge one stage (the focused scopes and bisect,
§12.5): a collective's bitwise data movement with its sentinel and poison values, the sharded
projection's valid prefix with an exactly-zero tail, the output half's valid prefix with an
untouched sentinel tail, and a stage's output given the same inputs as the golden's.

Axes are per rank: the leading rank axis of the stacked `[P, ...]` tensors the worker compares
is not counted in `valid_axis` (the comparator adds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class PoolCheck:
    """A cache/state pool compared only where the step wrote (spec validation.md §9)."""

    output: str
    mapping: str
    block_size: int
    atol: float
    rtol: float
    max_error_ratio: float = 0.005
    pool_name: str = "pool"


@dataclass(frozen=True)
class RelDiffCheck:
    """A floored relative-difference gate with a bad-point budget (validation.md §10).

    `concentrates_in`: the units ("rank", or an axis: "token", "hc") in which a correct
    implementation's bad points may gather, which the launcher's concentration check then
    leaves alone (CSA's token rows: a top-k flip of the indexer changes one token's row).
    `axes`: what the output's axes after the rank axis mean, which the error grids and the
    concentration check's units are named by (unnamed: row, axis2, ...).
    """

    output: str
    diff_thd: float
    pct_thd: float
    max_diff_hd: float
    concentrates_in: tuple[str, ...] = ()
    axes: tuple[str, ...] = ()


# The axes of a layer's hidden-state output (x_out, x_next): [t, hc, D].
HIDDEN_AXES = ("token", "hc", "channel")


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


@dataclass(frozen=True)
class ActiveRowsCheck:
    """`check` on the rows of the active tokens only (moe.md §13.5, for bisect): the first
    `rows_per_token · n` rows, n the 0-dim input named `active`. An inactive token's rows are
    never read downstream and a device may leave them stale (moe.md pitfall 4, §3.2).

    `order_by`: the name of a [rows, K] index output whose rows are sets (moe.md §13.5: top-k
    tie order may differ). Each side's rows are then taken in the ascending order of its own
    index row, so the index sets compare order-free and a paired tensor (the routing weights)
    moves with them.
    """

    check: StageCheck
    active: str = "num_tokens"
    rows_per_token: int = 1
    order_by: str | None = None

    @property
    def output(self) -> str:
        return self.check.output


Check = Union[PoolCheck, RelDiffCheck, StageCheck, ActiveRowsCheck]

# The parameters of each check that are tolerances, which a run may set (`tolerance.<tensor>.
# <param>`); the others (mappings, block sizes, valid rows, sentinels) are facts of the layer.
# An exact check has none: bitwise is its definition.
TOLERANCES: dict[type, tuple[str, ...]] = {
    PoolCheck: ("atol", "rtol", "max_error_ratio"),
    RelDiffCheck: ("diff_thd", "pct_thd", "max_diff_hd"),
    AllcloseCheck: ("atol", "rtol", "max_error_ratio"),
    PrefixTailCheck: ("atol", "rtol", "max_error_ratio"),
    ExactCheck: (),
}


def tolerance_params(check: Check) -> tuple[str, ...]:
    return TOLERANCES.get(type(check), ())


__all__ = ["PoolCheck", "RelDiffCheck", "StageCheck", "ExactCheck", "AllcloseCheck", "PrefixTailCheck",
           "ActiveRowsCheck", "Check", "TOLERANCES", "tolerance_params"]
