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
  finite        no non-finite value where the golden is finite (a pool's mapped rows; x_out);
  cap           no single value beyond a cap far outside its tolerance band (`CAPS`).

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

Pure tensor code on CPU: no torch.distributed, no layer code beyond the check dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from layers.contract.checks import Check, PoolCheck, RelDiffCheck

from launcher.verify.base import MAX_EXAMPLES, initial_key, unravel
from launcher.verify.pool import unchanged_rows

CAP_FACTOR = 128  # float tensors: the cap in tolerance bands
INT8_CAP_CODES = 16  # int8 pools: the cap in quantization codes

CHECKS = ("written_rows", "finite", "cap")


@dataclass
class IntegrityCheck:
    """One named integrity check of one tensor.

    `summary` is the short account a verdict line shows ("2 unwritten rows (rank 1)"), `detail`
    the full one (empty on pass). `figures`: `n_bad` (rows for written_rows, values otherwise),
    `numel` (rows or values looked at), `per_rank` (n_bad per rank), `examples` (the first few
    located points or rows); cap also `cap` (its rule), `max_ratio` (the largest |diff| / cap).
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
                     inputs: Mapping[str, torch.Tensor]) -> list[IntegrityCheck]:
    """The integrity checks of one compared output (stacked `[P, ...]`), in `CHECKS` order.

    Layer checks only: a focused scope's stage checks are bitwise or allow no bad point
    (max_error_ratio 0), so there is no budget to hide in. Nothing where shapes or dtypes
    disagree: the reference verdict already fails that contract.
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
        return [_written_rows(check.output, rows, a, e, None if initial is None else rows.of(initial)),
                _finite(check.output, values, a, e), _cap(check.output, values, a, e, limit, rule)]
    if isinstance(check, RelDiffCheck):
        p = actual.shape[0]
        a, e = actual.reshape(p, -1), expected.reshape(p, -1)
        values = _Values(p, lambda bad: bad.sum(dim=1).tolist(), lambda flat: {"at": unravel(flat, actual.shape)})
        band = CAP_FACTOR * check.diff_thd
        limit = e.to(torch.float32).abs().clamp_min_(1.0).mul_(band)
        rule = f"|diff| > {CAP_FACTOR}*diff_thd*max(1, |expected|) = {band:g}*max(1, |expected|)"
        return [_finite(check.output, values, a, e), _cap(check.output, values, a, e, limit, rule)]
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
