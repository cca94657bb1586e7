"""Integrity checks beside the reference comparators: what a pooled budget must never hide.

The reference comparators (validation.md §8-§10) pass a tensor while a share of its points is
out of tolerance by any amount: 0.5 % of a pool's mapped values, 0.8 % of x_out. A cache row
the implementation never wrote (two whole tokens at flash dims) or one value of 1e30 fits that
budget. These checks run beside the reference comparators, on the same stacked `[P, ...]`
tensors, and leave the reference verdicts as they are; the run fails on either (`integrity=false`
reports the reference verdict alone). Each check is named:

  written_rows  (pools) every row the step maps and the golden wrote was written by the
                implementation: a mapped row still bit-equal to the pool before the step, where
                the golden's is not, is a skipped write;
  stale_values  (pools) no value of a mapped row that is out of tolerance and still holds the
                pool's value from before the step, or holds exactly 0 (below);
  finite        no non-finite value where the golden is finite (a pool's mapped rows; x_out);
  cap           no single value beyond a cap far outside its tolerance band (below);
  concentration (x_out, x_next) no rank, token row or hc stream whose bad fraction is far above
                the rest of the tensor's (below).

The caps, per tensor kind (the band is the check's own tolerance, validation.md §7):

  float pools (bf16 KV caches, fp32 states and scales): |a - e| > 128 x (atol + rtol |e|).
      With rtol = 1/128 (every bf16 cache, the HCA state) that is 128 atol + |e|: an error
      larger than the golden value itself, where rounding or summation order give 1-2 ulps.
      For the CSA states (atol = rtol = 1e-3) it is 0.128 (1 + |e|), still 128 tolerances.
  int8 pools (the indexer cache, atol = 1 code): |a - e| > 16 codes; a legitimate difference
      is +-1 code (a quantizer tie, a one-ulp scale).
  x_out (ratio_reldiff, band diff_thd x max(1, |e|)): |a - e| > 128 x that band, 0.384 x
      max(1, |e|) at diff_thd 3e-3. ratio_reldiff's own cap bounds rdiff, which is relative to
      max(|a|, |e|): a value of 1e30 has rdiff 1 and passes a cap of 2 or inf.

stale_values, per element of the mapped rows (a kernel that stores zeros, or skips the last
vector of a row, changes the row, so written_rows sees it written; a 0 is never beyond the cap
128 atol + |e|). A value is stale when it is out of the pool's own tolerance,
|a - e| > atol + rtol |e| (validation.md §9: the reference's per-point rule; both finite, the
rest is the finite check's), and
  * a == 0 exactly: |e| is then beyond the tolerance of 0, and a rounding of e never lands on
    0 (nor does an int8 code 2 or more from 0, where a quantizer tie moves one code); or
  * a holds the bits of the pool's value from before the step, and |a - e| > 8 tolerances
    (`STALE_KEPT_FACTOR`). A rounding one tolerance out can land on the old value by chance
    when the step moved the value by a few ulps (measured: a few values a run of a noisy
    implementation, docs/integrity.md); an old value 8 tolerances from the new one is no
    rounding, and an unwritten part of a row keeps values unrelated to the new ones.
A value the golden left unchanged that the implementation kept is within tolerance, so never
stale; a legitimate 0 (golden 0, or within atol of it) is within tolerance too. Without the
pool from before the step only the zeros are looked for.

concentration, on the reference's own per-point rule (validation.md §10.2: rdiff > diff_thd,
non-finite counted bad). Rounding noise spreads over a tensor; a logic defect (a dropped MoE
route, one wrong hc stream) puts its bad points in a few units. A unit (a rank, a rank's token
row, a rank's hc stream: the check's `axes`; axes of length 1 and the rank at P = 1 are no units)
fails when all three hold:
  * at least 8 bad points (`CONCENTRATION_MIN_BAD`): a short unit is no evidence;
  * a bad fraction of at least 1/4 (`CONCENTRATION_FLOOR`): at a noise level near the budget
    the largest token row of a correct run is ~1/5 bad (MoE at 4.9 %), far less elsewhere;
  * 10 times the bad fraction of the rest of the tensor (`CONCENTRATION_FACTOR`): measured,
    the largest unit of a correct noisy run is at most ~4x the tensor (docs/integrity.md). The
    rest, not the whole, so that a unit's own bad points never raise its bar (one hc stream is
    an eighth of x_out at P = 2).
Units the layer says may gather a correct run's bad points (`RelDiffCheck.concentrates_in`)
are no units: CSA's x_out token rows, where the indexer's top-k flips for a token whose scores
moved by a code, and that token's row differs (measured: up to 0.40 of a row bad in runs the
reference passes). A tensor the run makes diagnostic (`tolerance.<t>.diagnostic`) has no
concentration check: where the budget decides nothing, neither does its companion; finite
and cap stay.

Pure tensor code on CPU: no torch.distributed, no layer code beyond the check dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from layers.contract.checks import Check, PoolCheck, RelDiffCheck

from launcher.config.verdict_words import CHECKS
from launcher.verify.base import MAX_EXAMPLES, initial_key, unravel
from launcher.verify.pool import unchanged_rows
from launcher.verify.ratio import ratio_reldiff
from launcher.verify.where import axis_names

CAP_FACTOR = 128  # float tensors: the cap in tolerance bands
INT8_CAP_CODES = 16  # int8 pools: the cap in quantization codes

STALE_KEPT_FACTOR = 8  # an old value kept counts beyond this many tolerances from the golden
CONCENTRATION_FACTOR = 10  # a unit's bad fraction, in multiples of the tensor's
CONCENTRATION_FLOOR = 0.25  # ... and at least this share of the unit's points
CONCENTRATION_MIN_BAD = 8  # ... and at least this many of them

_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class IntegrityCheck:
    """One named integrity check of one tensor.

    `summary` is the short account a verdict line shows ("2 unwritten rows (rank 1)"), `detail`
    the full one (empty on pass). `figures`: `n_bad` (rows for written_rows, units for
    concentration, values otherwise), `numel` (rows, units or values looked at), `per_rank`
    (n_bad per rank), `examples` (the first few located points, rows or units); cap also `cap`
    (its rule), `max_ratio` (the largest |diff| / cap); stale_values also `kept` and `zero` (its
    values by rule), `rows` (rows holding one), `initial` (whether the old pool was there);
    concentration also `rule`, `tensor_fraction` (the tensor's bad fraction) and `max_fraction`
    (per unit kind, the largest unit's; the measure of how concentrated a passing tensor is).
    """

    tensor: str
    check: str
    passed: bool
    summary: str = ""
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def integrity_checks(check: Check, actual: torch.Tensor, expected: torch.Tensor,
                     inputs: Mapping[str, torch.Tensor], diagnostic: bool = False) -> list[IntegrityCheck]:
    """The integrity checks of one compared output (stacked `[P, ...]`), in `CHECKS` order.

    Layer checks only: a focused scope's stage checks are bitwise or allow no bad point
    (max_error_ratio 0), so there is no budget to hide in. Nothing where shapes or dtypes
    disagree: the reference verdict already fails that contract. `diagnostic`: the run made
    this tensor's reference check a measurement: no concentration check then (the module says why).
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return []
    if isinstance(check, PoolCheck):
        rows = MappedRows(check, actual, inputs[check.mapping])
        a, e = rows.of(actual), rows.of(expected)
        initial = inputs.get(initial_key(check.output))
        if initial is not None and (initial.shape != actual.shape or initial.dtype != actual.dtype):
            initial = None
        values = _Values(rows.p, rows.per_rank, rows.locate_value(a.shape[1]))
        if actual.dtype == torch.int8:
            limit = torch.full(a.shape, float(INT8_CAP_CODES))
            rule = f"|diff| > {INT8_CAP_CODES} codes"
        else:
            limit = e.to(torch.float32).abs().mul_(CAP_FACTOR * check.rtol).add_(CAP_FACTOR * check.atol)
            rule = (f"|diff| > {CAP_FACTOR}*(atol + rtol*|expected|) = "
                    f"{CAP_FACTOR * check.atol:g} + {CAP_FACTOR * check.rtol:g}*|expected|")
        before = None if initial is None else rows.of(initial)
        return [_written_rows(check.output, rows, a, e, before),
                _stale_values(check.output, rows, values, a, e, before, check.atol, check.rtol),
                _finite(check.output, values, a, e), _cap(check.output, values, a, e, limit, rule)]
    if isinstance(check, RelDiffCheck):
        p = actual.shape[0]
        a, e = actual.reshape(p, -1), expected.reshape(p, -1)
        values = _Values(p, lambda bad: bad.sum(dim=1).tolist(), lambda flat: {"at": unravel(flat, actual.shape)})
        band = CAP_FACTOR * check.diff_thd
        limit = e.to(torch.float32).abs().clamp_min_(1.0).mul_(band)
        rule = f"|diff| > {CAP_FACTOR}*diff_thd*max(1, |expected|) = {band:g}*max(1, |expected|)"
        found = [_finite(check.output, values, a, e), _cap(check.output, values, a, e, limit, rule)]
        return found if diagnostic else [*found, _concentration(check, actual, expected)]
    return []


def golden_nonfinite(check: Check, golden: torch.Tensor, mapping: torch.Tensor | None) -> int:
    """How many values of one rank's golden are non-finite where it must be finite: a pool's
    mapped rows (its unmapped rows may hold -inf sentinels, validation.md §14.5), all of x_out.
    Focused scopes' stage checks: the whole tensor."""
    if not golden.is_floating_point():
        return 0
    if isinstance(check, PoolCheck):
        golden = MappedRows(check, golden[None], mapping[None]).of(golden[None])
    return int((~torch.isfinite(golden)).sum())


class MappedRows:
    """The rows a stacked pool `[P, NB, block, ...]` maps, in (rank, mapping item) order.

    Mapping entries outside `[0, rows)` are left out: they are the reference comparator's
    fixture error to report, not an integrity question.
    """

    def __init__(self, check: PoolCheck, pool: torch.Tensor, mapping: torch.Tensor):
        self.p, self.block_size = pool.shape[0], check.block_size
        self.rows_per_rank = pool.shape[1] * pool.shape[2]
        m = mapping.reshape(self.p, -1).to(torch.int64)
        valid = (m >= 0) & (m < self.rows_per_rank)
        self.rank = torch.arange(self.p)[:, None].expand_as(m)[valid]
        self.row = m[valid]
        self.item = torch.arange(m.shape[1])[None, :].expand_as(m)[valid]
        self.keys = self.rank * self.rows_per_rank + self.row

    def of(self, pool: torch.Tensor) -> torch.Tensor:
        """`[n_mapped, W]`: the mapped rows of `pool` (same layout as the one this was built on)."""
        return pool.reshape(self.p * self.rows_per_rank, -1)[self.keys]

    def per_rank(self, bad: torch.Tensor) -> list[int]:
        """Bad rows (`[n_mapped]`) or values (`[n_mapped, W]`) per rank."""
        # No mapped row (a step that writes no compressed row): reshape cannot infer -1 from 0.
        per_row = bad.reshape(len(self.keys), -1).sum(dim=1) if len(self.keys) else torch.zeros(0, dtype=torch.int64)
        return torch.zeros(self.p, dtype=torch.int64).index_add_(0, self.rank, per_row).tolist()

    def where(self, g: int) -> dict[str, int]:
        """Mapped row `g` located: rank, physical block and row in it, pool row, token."""
        row = int(self.row[g])
        return {"rank": int(self.rank[g]), "block": row // self.block_size, "intra": row % self.block_size,
                "row": row, "token": int(self.item[g])}

    def locate_value(self, width: int) -> Callable[[int], dict[str, int]]:
        return lambda flat: {**self.where(flat // width), "col": flat % width}


@dataclass
class _Values:
    """The values one check looks at: how many ranks, the bad ones per rank, where one is."""

    p: int
    per_rank: Callable[[torch.Tensor], list[int]]
    locate: Callable[[int], dict[str, Any]]


def _ranks_text(per_rank: list[int]) -> str:
    return ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank) if n)


def _where_text(point: Mapping[str, Any]) -> str:
    if "block" in point:
        return (f"(rank={point['rank']}, block={point['block']}, intra={point['intra']}) row={point['row']} "
                f"token={point['token']}" + (f" col={point['col']}" if "col" in point else ""))
    return f"at {tuple(point['at'])}"


def _written_rows(tensor: str, rows: MappedRows, a: torch.Tensor, e: torch.Tensor,
                  initial: torch.Tensor | None) -> IntegrityCheck:
    if initial is None:  # the worker always hands the pool before the step; a caller may not
        return IntegrityCheck(tensor, "written_rows", False, "not checked: no pool from before the step",
                              "    written_rows: no pool from before the step to tell written rows from unwritten ones",
                              {"n_bad": 0, "numel": 0, "per_rank": [0] * rows.p, "examples": []})
    golden_wrote = ~unchanged_rows(e, initial)
    skipped = golden_wrote & unchanged_rows(a, initial)
    per_rank = rows.per_rank(skipped)
    n, n_golden = int(skipped.sum()), int(golden_wrote.sum())
    examples = [rows.where(g) for g in skipped.nonzero().flatten()[:MAX_EXAMPLES].tolist()]
    figures = {"n_bad": n, "numel": n_golden, "per_rank": per_rank, "examples": examples}
    if not n:
        return IntegrityCheck(tensor, "written_rows", True, figures=figures)
    lines = [f"    written_rows: {n} of the {n_golden} mapped row(s) the golden wrote still hold their value from "
             f"before the step in the actual pool (writes the implementation skipped; {_ranks_text(per_rank)})"]
    lines += [f"      {_where_text(x)}" for x in examples]
    return IntegrityCheck(tensor, "written_rows", False, f"{n} unwritten row(s) ({_ranks_text(per_rank)})",
                          "\n".join(lines), figures)


def _all_finite(t: torch.Tensor) -> bool:
    """True when every value is finite, from one sum: a NaN or Inf makes it non-finite, and so
    may an overflow of finite values (False then only sends the caller down the exact path).
    A whole-tensor isfinite mask costs ~100x the sum on the passing path."""
    return not t.is_floating_point() or bool(torch.isfinite(t.sum()))


def _finite(tensor: str, values: _Values, a: torch.Tensor, e: torch.Tensor) -> IntegrityCheck:
    figures = {"n_bad": 0, "numel": a.numel(), "per_rank": [0] * values.p, "examples": []}
    if _all_finite(a):
        return IntegrityCheck(tensor, "finite", True, figures=figures)
    bad = ~torch.isfinite(a) & torch.isfinite(e)
    n = int(bad.count_nonzero())
    if not n:
        return IntegrityCheck(tensor, "finite", True, figures=figures)
    per_rank = values.per_rank(bad)
    fa = a.reshape(-1)
    examples = [{**values.locate(i), "actual": float(fa[i])}
                for i in bad.reshape(-1).nonzero().flatten()[:MAX_EXAMPLES].tolist()]
    figures.update(n_bad=n, per_rank=per_rank, examples=examples)
    lines = [f"    finite: {n} non-finite actual value(s) where the golden is finite ({_ranks_text(per_rank)})"]
    lines += [f"      {_where_text(x)}: actual={x['actual']}" for x in examples]
    return IntegrityCheck(tensor, "finite", False, f"{n} non-finite value(s) ({_ranks_text(per_rank)})",
                          "\n".join(lines), figures)


def _cap(tensor: str, values: _Values, a: torch.Tensor, e: torch.Tensor, limit: torch.Tensor,
         rule: str) -> IntegrityCheck:
    a32, e32 = a.to(torch.float32), e.to(torch.float32)
    ratio = (a32 - e32).abs_().div_(limit)  # in place: at flash dims x_out is 8 Mi values
    if not (_all_finite(a32) and _all_finite(e32)):  # non-finite values are the finite check's
        ratio = torch.where(torch.isfinite(a32) & torch.isfinite(e32), ratio, 0.0)
    max_ratio = float(ratio.max()) if ratio.numel() else 0.0
    figures = {"n_bad": 0, "numel": a.numel(), "per_rank": [0] * values.p, "examples": [], "cap": rule,
               "max_ratio": max_ratio if max_ratio != float("inf") else None}
    if not max_ratio > 1.0:  # a diff equal to the cap is inside it
        return IntegrityCheck(tensor, "cap", True, figures=figures)
    bad = ratio > 1.0
    n = int(bad.count_nonzero())
    per_rank = values.per_rank(bad)
    idx = bad.reshape(-1).nonzero().flatten()
    worst = idx[torch.topk(ratio.reshape(-1)[idx], min(MAX_EXAMPLES, len(idx))).indices].tolist()
    fa, fe, fl = a32.reshape(-1), e32.reshape(-1), limit.reshape(-1)
    # The difference in Python floats (doubles): two finite fp32 values of opposite sign may
    # differ by more than fp32 holds.
    examples = [{**values.locate(i), "actual": float(fa[i]), "expected": float(fe[i]),
                 "diff": abs(float(fa[i]) - float(fe[i])), "cap": float(fl[i])} for i in worst]
    figures.update(n_bad=n, per_rank=per_rank, examples=examples)
    lines = [f"    cap: {n} value(s) beyond the cap {rule} ({_ranks_text(per_rank)}); the worst first:"]
    lines += [f"      {_where_text(x)}: actual={x['actual']:.8g}, expected={x['expected']:.8g}, "
              f"diff={x['diff']:.4g}, cap={x['cap']:.4g}" for x in examples]
    return IntegrityCheck(tensor, "cap", False, f"{n} value(s) beyond the cap ({_ranks_text(per_rank)}; "
                          f"the worst |diff| {examples[0]['diff']:.3g})", "\n".join(lines), figures)


def _stale_values(tensor: str, rows: MappedRows, values: _Values, a: torch.Tensor, e: torch.Tensor,
                  initial: torch.Tensor | None, atol: float, rtol: float) -> IntegrityCheck:
    """Mapped values out of tolerance that hold the value from before the step or exactly 0."""
    a32, e32 = a.to(torch.float32), e.to(torch.float32)
    diff, tol = (a32 - e32).abs_(), e32.abs().mul_(rtol).add_(atol)
    bad = diff > tol
    if not (_all_finite(a32) and _all_finite(e32)):  # non-finite values are the finite check's
        bad &= torch.isfinite(a32) & torch.isfinite(e32)
    zero = bad & (a32 == 0)
    kept = torch.zeros_like(bad)
    if initial is not None:
        as_int = _SAME_WIDTH_INT[a.element_size()]
        kept = (a.view(as_int) == initial.view(as_int)) & bad & (diff > tol.mul_(STALE_KEPT_FACTOR))
    stale = kept | zero
    n = int(stale.count_nonzero())
    figures = {"n_bad": n, "numel": a.numel(), "per_rank": [0] * values.p, "examples": [], "kept": 0, "zero": 0,
               "rows": 0, "initial": initial is not None}
    if not n:
        return IntegrityCheck(tensor, "stale_values", True, figures=figures)
    per_rank = values.per_rank(stale)
    n_kept, n_zero = int(kept.count_nonzero()), int((zero & ~kept).count_nonzero())
    n_rows = int(stale.any(dim=1).count_nonzero())
    flat_a, flat_e = a32.reshape(-1), e32.reshape(-1)
    flat_i = None if initial is None else initial.to(torch.float32).reshape(-1)
    examples = [{**values.locate(i), "actual": float(flat_a[i]), "expected": float(flat_e[i]),
                 "before": None if flat_i is None else float(flat_i[i])}
                for i in stale.reshape(-1).nonzero().flatten()[:MAX_EXAMPLES].tolist()]
    figures.update(n_bad=n, per_rank=per_rank, examples=examples, kept=n_kept, zero=n_zero, rows=n_rows)
    how = f"{n_kept} as before the step, {n_zero} zero"
    lines = [f"    stale_values: {n} value(s) in {n_rows} mapped row(s) out of tolerance of the golden and "
             f"still holding the pool's value from before the step or exactly 0 ({how}; writes the "
             f"implementation skipped or zeroed; {_ranks_text(per_rank)})"]
    if initial is None:
        lines.append("      no pool from before the step: only the zeros were looked for")
    lines += [f"      {_where_text(x)}: actual={x['actual']:.8g}, expected={x['expected']:.8g}"
              + ("" if x["before"] is None else f", before={x['before']:.8g}") for x in examples]
    return IntegrityCheck(tensor, "stale_values", False, f"{n} stale value(s) in {n_rows} row(s) "
                          f"({_ranks_text(per_rank)}; {how})", "\n".join(lines), figures)


def _concentration(check: RelDiffCheck, actual: torch.Tensor, expected: torch.Tensor) -> IntegrityCheck:
    """Ranks, token rows and middle-axis slices (x_out's hc streams) whose bad fraction is far
    above the rest of the tensor's."""
    p = actual.shape[0]
    a32, e32 = actual.to(torch.float32), expected.to(torch.float32)
    _, rdiff = ratio_reldiff(check.diff_thd, check.pct_thd, check.max_diff_hd).rdiff(a32, e32)
    bad = rdiff > check.diff_thd  # the reference's per-point rule (validation.md §10.2)
    if not (_all_finite(a32) and _all_finite(e32)):
        bad |= ~(torch.isfinite(a32) & torch.isfinite(e32))
    del rdiff
    n_bad = int(bad.count_nonzero())
    fraction = n_bad / bad.numel() if bad.numel() else 0.0
    rule = (f"a unit with >= {CONCENTRATION_MIN_BAD} bad points and a bad fraction >= {CONCENTRATION_FLOOR:g} "
            f"and >= {CONCENTRATION_FACTOR} x the rest of the tensor's")
    names = axis_names(check, actual.dim())
    units = [("rank", bad.reshape(p, -1).sum(dim=1, keepdim=True))] if p > 1 else []
    for axis in range(1, actual.dim() - 1):  # the last axis holds one row's channels: no unit
        if actual.shape[axis] > 1:  # a unit of one is the whole rank
            units.append((names[axis - 1], bad.movedim(axis, 1).reshape(p, actual.shape[axis], -1).sum(dim=2)))
    units = [(name, counts) for name, counts in units if name not in check.concentrates_in]
    size = {name: bad[0].numel() // counts.shape[1] for name, counts in units}
    figures: dict[str, Any] = {"n_bad": 0, "numel": sum(c.numel() for _, c in units), "per_rank": [0] * p,
                               "examples": [], "rule": rule, "tensor_fraction": fraction,
                               "max_fraction": {name: (float(c.max()) / size[name] if c.numel() else 0.0)
                                                for name, c in units}}
    if not n_bad:
        return IntegrityCheck(check.output, "concentration", True, figures=figures)
    found = []
    for name, counts in units:
        # Against the rest of the tensor: a unit's own bad points must not raise its own bar
        # (a wrong hc stream is an eighth of x_out at P = 2).
        rest = (n_bad - counts).to(torch.float64) / (bad.numel() - size[name])
        share = counts.to(torch.float64) / size[name]
        flagged = ((counts >= CONCENTRATION_MIN_BAD) & (share >= CONCENTRATION_FLOOR)
                   & (share >= CONCENTRATION_FACTOR * rest))
        for r, i in flagged.nonzero().tolist():
            c = int(counts[r, i])
            found.append({"unit": name, "rank": r, **({} if name == "rank" else {name: i}), "bad": c,
                          "numel": size[name], "fraction": c / size[name]})
    if not found:
        return IntegrityCheck(check.output, "concentration", True, figures=figures)
    per_rank = torch.bincount(torch.tensor([u["rank"] for u in found]), minlength=p).tolist()
    found.sort(key=lambda u: -u["fraction"])
    figures.update(n_bad=len(found), per_rank=per_rank, examples=found[:MAX_EXAMPLES])
    kinds = sorted({u["unit"] for u in found})
    lines = [f"    concentration: {len(found)} unit(s) ({', '.join(kinds)}) with a bad fraction far above the "
             f"tensor's {fraction:.3%} (rule: {rule}; {_ranks_text(per_rank)}); numerical noise spreads over "
             "a tensor, a logic defect concentrates; the worst first:"]
    lines += [f"      {_unit_text(u)}: {u['bad']}/{u['numel']} bad ({u['fraction']:.1%})" for u in found[:MAX_EXAMPLES]]
    worst = found[0]
    return IntegrityCheck(check.output, "concentration", False,
                          f"{len(found)} unit(s) far above the tensor's bad fraction {fraction:.2%} "
                          f"({_ranks_text(per_rank)}; the worst {_unit_text(worst)}: {worst['fraction']:.0%} bad)",
                          "\n".join(lines), figures)


def _unit_text(unit: Mapping[str, Any]) -> str:
    name = unit["unit"]
    return f"rank {unit['rank']}" + ("" if name == "rank" else f" {name} {unit[name]}")
