"""Comparators: one compared output (actual vs golden) -> a verdict (spec validation.md §6–§11).

Owns the reference-compatible comparator factories and `validate_golden`, with the reference's
pass rules, labels (`__name__`) and failure texts, plus structured figures for our report
(§14, §15). Pure tensor code on CPU: no torch.distributed, no layer code (only the check
dataclasses of `layers.base`, which `build_comparator` turns into comparators).

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

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from layers.contract.checks import Check, PoolCheck, RelDiffCheck
from layers.contract.checks import StageCheck

INITIAL_PREFIX = "initial:"
MAX_EXAMPLES = 8  # stray rows / non-finite coordinates listed per side or per rank
PERMUTATION_MAX_RANKS = 8  # the rank-permutation hint costs P full passes over the tensor
PERMUTATION_FACTOR = 0.25  # "far better": mean |diff| against r' below this share of against r
QUANTILE_MAX = 1 << 24  # torch.quantile refuses larger inputs (§14.16)

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

_CATEGORY = {
    "shape": "contract",
    "dtype": "contract",
    "layout": "contract",
    "config": "contract",
    "valid_rows": "contract",
    "mapping": "fixture",
}


def initial_key(output: str) -> str:
    """The `inputs` key under which a pool's pre-step snapshot is handed to its comparator."""
    return INITIAL_PREFIX + output


# -- results ----------------------------------------------------------------------------------


@dataclass
class RankFigures:
    """One rank's share of a comparison (the gating budget itself stays pooled)."""

    rank: int
    numel: int = 0
    n_bad: int = 0
    max_abs_diff: float | None = None
    max_abs_diff_at: tuple[int, ...] | None = None
    worst: float | None = None  # rdiff or diff/tol of its worst bad point; 0 when none is bad
    nan_actual: int = 0
    inf_actual: int = 0
    nan_expected: int = 0
    inf_expected: int = 0
    # mapped pools only
    mapped_rows: int | None = None
    stray_rows: int | None = None
    stray_examples: list[dict[str, Any]] = field(default_factory=list)
    stray_by_side: dict[str, int] | None = None
    unwritten_rows: int | None = None
    # ranked elementwise comparators, failing only: expected rank matching this one far better
    best_match_rank: int | None = None
    # error_distribution only
    distribution: dict[str, Any] | None = None


@dataclass
class Verdict:
    """One output's judgement.

    `kind` names the check that decided a failure: shape, dtype, layout (pool block layout or
    rank count), config (missing input, vals_name, dim), valid_rows, mapping (slot-mapping
    dtype/shape/sentinel/range/duplicate), zero_tail, nonfinite, stray, budget, cap,
    budget+cap, mismatch (exact / allclose / top-k order) or custom (a foreign comparator).
    `category` says whom it blames: contract (shape, dtype, layout, config, valid_rows),
    fixture (mapping), golden (non-finite values or stray writes on the expected side only)
    or implementation (everything else).
    """

    passed: bool
    label: str
    detail: str = ""
    kind: str | None = None
    category: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    per_rank: list[RankFigures] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Judgement:
    """A numeric comparison before it is wrapped into a Verdict (pools reuse ratio_allclose's)."""

    passed: bool
    kind: str | None
    reference: str
    extras: list[str]
    figures: dict[str, Any]
    per_rank: list[RankFigures]


def _category(kind: str | None, figures: Mapping[str, Any]) -> str | None:
    if kind is None:
        return None
    if kind in _CATEGORY:
        return _CATEGORY[kind]
    if kind == "nonfinite" and not (figures.get("nan_actual") or figures.get("inf_actual")):
        return "golden"
    if kind == "stray" and figures.get("stray_by_side"):
        sides = figures["stray_by_side"]
        if sides.get("expected") and not (sides.get("actual") or sides.get("both")):
            return "golden"
    return "implementation"


def _join(reference: str, extras: Sequence[str]) -> str:
    return "\n".join([reference, *extras]) if extras else reference


# -- base class -------------------------------------------------------------------------------


class Comparator(abc.ABC):
    """A comparator with the reference call convention (§6.1) and a structured `evaluate`."""

    __name__: str

    @property
    def label(self) -> str:
        return self.__name__

    def __call__(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        *,
        actual_outputs: Mapping[str, torch.Tensor] | None = None,
        expected_outputs: Mapping[str, torch.Tensor] | None = None,
        inputs: Mapping[str, torch.Tensor] | None = None,
        rtol: float = 1e-5,
        atol: float = 1e-5,
    ) -> tuple[bool, str]:
        v = self.evaluate(
            actual, expected, inputs=inputs, actual_outputs=actual_outputs,
            expected_outputs=expected_outputs, rtol=rtol, atol=atol,
        )
        return v.passed, v.detail

    @abc.abstractmethod
    def evaluate(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        *,
        inputs: Mapping[str, torch.Tensor] | None = None,
        actual_outputs: Mapping[str, torch.Tensor] | None = None,
        expected_outputs: Mapping[str, torch.Tensor] | None = None,
        rtol: float = 1e-5,
        atol: float = 1e-5,
    ) -> Verdict:
        """Judge one output; never raises on NaN/Inf, shape or dtype problems."""

    def _verdict(self, passed: bool, kind: str | None, detail: str, figures: dict[str, Any],
                 per_rank: list[RankFigures] | None = None, notes: list[str] | None = None) -> Verdict:
        return Verdict(
            passed=passed, label=self.__name__, detail="" if passed else detail,
            kind=None if passed else kind, category=None if passed else _category(kind, figures),
            figures=figures, per_rank=per_rank or [], notes=notes or [],
        )


# -- shared helpers ---------------------------------------------------------------------------


def _base_figures(actual: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(actual.shape), "dtype": str(actual.dtype)}


def _mismatch_verdict(cmp: Comparator, actual: torch.Tensor, expected: torch.Tensor,
                      prefix: str = "") -> Verdict | None:
    """A FAIL on unequal shapes, then dtypes (§14.9); `prefix` names the tensor in the message."""
    if actual.shape == expected.shape and actual.dtype == expected.dtype:
        return None
    figures = {**_base_figures(actual), "expected_shape": list(expected.shape), "expected_dtype": str(expected.dtype)}
    if actual.shape != expected.shape:
        return cmp._verdict(False, "shape", f"    {prefix}shape mismatch: actual={tuple(actual.shape)} "
                                            f"expected={tuple(expected.shape)}", figures)
    return cmp._verdict(False, "dtype", f"    {prefix}dtype mismatch: actual={actual.dtype} "
                                        f"expected={expected.dtype}", figures)


def _valid_prefix(actual: torch.Tensor, expected: torch.Tensor, valid_rows: int | None, valid_axis: int,
                  zero_tail: bool) -> tuple[torch.Tensor, torch.Tensor, str | None, str]:
    """Restrict both sides to the first `valid_rows` along `valid_axis` (§6.3).

    With `zero_tail`, the actual tail must be all zeros (the expected tail is not inspected,
    as in the reference). Returns `(actual', expected', failure kind, error text)`.
    """
    if valid_rows is None:
        return actual, expected, None, ""
    total = actual.shape[valid_axis]
    if not 0 <= valid_rows <= total:
        return actual, expected, "valid_rows", (
            f"    valid_rows={valid_rows} out of range for axis {valid_axis} of length {total}")
    if zero_tail:
        tail_nonzero = int(actual.narrow(valid_axis, valid_rows, total - valid_rows).count_nonzero())
        if tail_nonzero:
            return actual, expected, "zero_tail", f"    inactive tail contains {tail_nonzero} nonzero values"
    return actual.narrow(valid_axis, 0, valid_rows), expected.narrow(valid_axis, 0, valid_rows), None, ""


def _prepare(cmp: Comparator, actual: torch.Tensor, expected: torch.Tensor, valid_rows: int | None,
             valid_axis: int, zero_tail: bool) -> tuple[Verdict | None, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Shape/dtype check, valid prefix, fp32 CPU copies (a 0-dim tensor becomes shape (1,))."""
    figures = _base_figures(actual)
    mismatch = _mismatch_verdict(cmp, actual, expected)
    if mismatch:
        return mismatch, actual, expected, figures
    actual, expected, kind, error = _valid_prefix(actual.cpu(), expected.cpu(), valid_rows, valid_axis, zero_tail)
    if error:
        return cmp._verdict(False, kind, error, figures), actual, expected, figures
    if actual.numel() == 0:
        return cmp._verdict(True, None, "", {**figures, "numel": 0, "n_bad": 0}), actual, expected, figures
    shape = actual.shape or (1,)
    a = actual.to(torch.float32).contiguous().reshape(shape)
    e = expected.to(torch.float32).contiguous().reshape(shape)
    return None, a, e, figures


def _pooled_note(per_rank: Sequence[RankFigures], passed: bool) -> list[str]:
    bad = [r for r in per_rank if r.n_bad]
    if not passed or len(per_rank) < 2 or not bad:
        return []
    ranks = ", ".join(f"rank {r.rank}: {r.n_bad}/{r.numel}" for r in bad)
    return [f"    within the pooled budget, bad points on {ranks}"]


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def _bounds(t: torch.Tensor, rank_axis: bool) -> list[tuple[int, int]]:
    """Each rank's [start, stop) along the leading axis (one 'rank' when not ranked)."""
    if rank_axis:
        return [(r, r + 1) for r in range(t.shape[0])]
    return [(0, t.shape[0])]


def _nonfinite_by_rank(a: torch.Tensor, e: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[dict[str, int]]:
    out = []
    for s, stop in bounds:  # one iteration per rank (P is a handful), each on its own slice
        a_r, e_r = a[s:stop], e[s:stop]
        out.append({
            "nan_actual": int(torch.isnan(a_r).sum()), "inf_actual": int(torch.isinf(a_r).sum()),
            "nan_expected": int(torch.isnan(e_r).sum()), "inf_expected": int(torch.isinf(e_r).sum()),
        })
    return out


def _sum_counts(per_rank: Sequence[Mapping[str, int]]) -> dict[str, int]:
    keys = ("nan_actual", "inf_actual", "nan_expected", "inf_expected")
    return {k: sum(c[k] for c in per_rank) for k in keys}


def _nonfinite_text(c: Mapping[str, int]) -> str:
    return ("    illegal values in comparison: "
            f"actual: NaN={c['nan_actual']} Inf={c['inf_actual']}; "
            f"expected: NaN={c['nan_expected']} Inf={c['inf_expected']}")


Locate = Callable[[int], dict[str, Any]]


def _plain_locator(shape: Sequence[int]) -> Locate:
    return lambda flat: {"at": _unravel(flat, shape)}


_POOL_LOCATION = ("rank", "block", "intra", "item", "col")


def _where(point: Mapping[str, Any]) -> str:
    """A point's location: pool points by rank/block/intra/item/col, others by coordinate."""
    if "block" in point:
        return " ".join(f"{k}={point[k]}" for k in _POOL_LOCATION)
    return f"at {tuple(point['at'])}"


def _nonfinite_lines(a: torch.Tensor, e: torch.Tensor, locate: Locate) -> list[str]:
    lines = []
    for side, t in (("actual", a), ("expected", e)):
        flat = (~torch.isfinite(t)).flatten().nonzero().flatten()[:MAX_EXAMPLES].tolist()
        if flat:
            vals = t.flatten()
            pts = ", ".join(f"{_where(locate(i))}={float(vals[i])}" for i in flat)
            lines.append(f"    first non-finite {side} values: {pts}")
    return lines


def _rank_figures(bounds: Sequence[tuple[int, int]], nonfinite: Sequence[Mapping[str, int]],
                  diff: torch.Tensor, bad: torch.Tensor, score: torch.Tensor | None,
                  locate: Locate) -> list[RankFigures]:
    stride = diff[0].numel() if diff.dim() else 1
    flat_diff = diff.view(-1)
    out = []
    for r, (s, stop) in enumerate(bounds):  # one iteration per rank (P is a handful)
        d = flat_diff[s * stride: stop * stride]
        rf = RankFigures(rank=r, numel=d.numel(), **nonfinite[r])
        if d.numel():
            b = bad.view(-1)[s * stride: stop * stride]
            rf.n_bad = int(b.sum())
            i = int(d.argmax())
            rf.max_abs_diff = float(d[i])
            rf.max_abs_diff_at = tuple(locate(s * stride + i)["at"])
            rf.worst = 0.0
            if rf.n_bad:
                rf.worst = float(torch.where(b, score.view(-1)[s * stride: stop * stride], 0.0).max())
        out.append(rf)
    return out


def _totals(per_rank: Sequence[RankFigures]) -> dict[str, Any]:
    """Pooled figures from the per-rank ones (ties resolve to the lowest rank, as a flat argmax)."""
    figures: dict[str, Any] = {"numel": sum(r.numel for r in per_rank), "n_bad": sum(r.n_bad for r in per_rank)}
    with_values = [r for r in per_rank if r.numel]
    top = max(with_values, key=lambda r: r.max_abs_diff, default=None)
    figures["max_abs_diff"] = top.max_abs_diff if top else None
    figures["max_abs_diff_at"] = top.max_abs_diff_at if top else None
    figures["worst"] = max((r.worst for r in with_values), default=None)
    figures["ranks_with_bad"] = [r.rank for r in per_rank if r.n_bad]
    return figures


def _points(indices: Sequence[int], a: torch.Tensor, e: torch.Tensor, diff: torch.Tensor, locate: Locate,
            measure_name: str | None = None, measure: torch.Tensor | None = None) -> list[dict[str, Any]]:
    fa, fe, fd = a.reshape(-1), e.reshape(-1), diff.view(-1)
    points = []
    for i in indices:
        p = {**locate(i), "flat": i, "actual": float(fa[i]), "expected": float(fe[i]), "diff": float(fd[i])}
        if measure_name:
            p[measure_name] = float(measure.view(-1)[i])
        points.append(p)
    return points


def _point_lines(title: str, points: Sequence[Mapping[str, Any]], measure_name: str) -> list[str]:
    if not points:
        return []
    lines = [f"    {title}:"]
    for p in points:
        lines.append(f"      {_where(p)} actual={p['actual']:.8g}, expected={p['expected']:.8g}, "
                     f"diff={p['diff']:.4g}, {measure_name}={p[measure_name]:.4g}")
    return lines


def _listed(bad: torch.Tensor, score: torch.Tensor | None, k: int) -> tuple[list[int], list[int]]:
    """Flat indices of the first k bad points (flat order) and of the worst k (by score)."""
    idx = bad.view(-1).nonzero().flatten()
    if score is None or not len(idx):
        return idx[:k].tolist(), []
    worst = idx[torch.topk(score.view(-1)[idx], min(k, len(idx))).indices]
    return idx[:k].tolist(), worst.tolist()


def _rank_lines(per_rank: Sequence[RankFigures]) -> list[str]:
    if len(per_rank) < 2:
        return []

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    lines = ["    per rank (the budget is pooled):"]
    for r in per_rank:
        line = (f"      rank {r.rank}: bad={r.n_bad}/{r.numel} max_abs_diff={fmt(r.max_abs_diff)} "
                f"worst={fmt(r.worst)} NaN(a/e)={r.nan_actual}/{r.nan_expected} "
                f"Inf(a/e)={r.inf_actual}/{r.inf_expected}")
        if r.mapped_rows is not None:
            line += f" mapped_rows={r.mapped_rows} stray_rows={r.stray_rows}"
            if r.unwritten_rows:
                line += f" unwritten_rows={r.unwritten_rows}"
        lines.append(line)
    return lines


def _permutation_hint(a: torch.Tensor, e: torch.Tensor, per_rank: list[RankFigures],
                      figures: dict[str, Any]) -> list[str]:
    """Does actual rank r match expected rank r' far better than its own? (a2a / scatter bugs)."""
    p = a.shape[0]
    if not 2 <= p <= PERMUTATION_MAX_RANKS or figures.get("nan_actual") or figures.get("inf_actual") \
            or figures.get("nan_expected") or figures.get("inf_expected"):
        return []
    a2, e2 = a.reshape(p, -1), e.reshape(p, -1)
    # one pass per expected rank r' (P <= 8) gives column r' of the matrix
    mean_abs = torch.stack([(a2 - e2[j]).abs().mean(dim=1) for j in range(p)], dim=1)
    figures["rank_mean_abs_diff"] = mean_abs.tolist()
    perm, lines = {}, []
    for r, j in enumerate(mean_abs.argmin(dim=1).tolist()):
        own, other = float(mean_abs[r, r]), float(mean_abs[r, j])
        if j != r and other < PERMUTATION_FACTOR * own:
            perm[r] = j
            per_rank[r].best_match_rank = j
            lines.append(f"    rank permutation hint: actual rank {r} matches expected rank {j} "
                         f"(mean |diff| {other:.4g} vs {own:.4g} against expected rank {r})")
    figures["rank_permutation"] = perm or None
    return lines


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
        early, a, e, figures = _prepare(self, actual, expected, self.valid_rows, self.valid_axis, self.zero_tail)
        if early:
            return early
        eff_atol, eff_rtol = self.effective(rtol, atol)
        j = self._judge(a, e, eff_atol, eff_rtol, _bounds(a, self.rank_axis), _plain_locator(a.shape))
        figures.update(j.figures)
        extras = list(j.extras)
        if not j.passed:
            extras += _rank_lines(j.per_rank)
            if self.rank_axis:
                extras += _permutation_hint(a, e, j.per_rank, figures)
        return self._verdict(j.passed, j.kind, _join(j.reference, extras), figures, j.per_rank,
                             _pooled_note(j.per_rank, j.passed))

    def _judge(self, a: torch.Tensor, e: torch.Tensor, eff_atol: float, eff_rtol: float,
               bounds: Sequence[tuple[int, int]], locate: Locate, *, located: bool = False) -> _Judgement:
        """§8.2 steps 5–9 on fp32 tensors whose leading axis is split per rank by `bounds`.

        `located`: the points' coordinates mean more than the flat index (pools), so the first
        mismatches are listed once more with them.
        """
        nonfinite = _nonfinite_by_rank(a, e, bounds)
        counts = _sum_counts(nonfinite)
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
        per_rank = _rank_figures(bounds, nonfinite, diff, bad, score, locate)
        figures.update(_totals(per_rank))
        numel = figures["numel"]
        threshold = round(self.max_error_ratio * numel)
        figures.update(threshold=threshold, margin=n_bad - threshold)
        if any_nonfinite:
            return _Judgement(False, "nonfinite", _nonfinite_text(counts), _nonfinite_lines(a, e, locate),
                              figures, per_rank)
        flat_max = int(diff.view(-1).argmax())
        figures["tol_at_max"] = float(tol.view(-1)[flat_max])
        first, worst = _listed(bad, score, self.max_show)
        figures["worst_at"] = tuple(locate(worst[0])["at"]) if worst else None
        figures["first_bad"] = _points(first, a, e, diff, locate, "tol", tol)
        figures["worst_bad"] = _points(worst, a, e, diff, locate, "tol", tol)
        if n_bad <= threshold:
            return _Judgement(True, None, "", [], figures, per_rank)
        lines = [f"    [{p['flat']}] actual={p['actual']:.8g}, expected={p['expected']:.8g}, "
                 f"diff={p['diff']:.4g}, tol={p['tol']:.4g}" for p in figures["first_bad"]]
        reference = (
            f"    ratio_allclose fail: error_count={n_bad}/{numel} "
            f"(ratio={n_bad / numel:.4%}, allowed<={self.max_error_ratio:.4%}, threshold={threshold} pts)\n"
            f"    atol={eff_atol} rtol={eff_rtol}\n"
            f"    max abs diff={float(diff.view(-1)[flat_max]):.6g} at {_unravel(flat_max, a.shape)} "
            f"(tol={figures['tol_at_max']:.6g})\n"
            f"    first {len(lines)} mismatches:\n" + "\n".join(lines)
        )
        extras = [f"    margin: {n_bad - threshold} pts over the budget"]
        if located:
            extras += _point_lines(f"first {len(first)} mismatches located", figures["first_bad"], "tol")
        extras += _point_lines(f"worst {len(worst)} mismatches (by diff/tol)", figures["worst_bad"], "tol")
        return _Judgement(False, "budget", reference, extras, figures, per_rank)


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
        early, a, e, figures = _prepare(self, actual, expected, self.valid_rows, self.valid_axis, self.zero_tail)
        if early:
            return early
        bounds, locate = _bounds(a, self.rank_axis), _plain_locator(a.shape)
        nonfinite = _nonfinite_by_rank(a, e, bounds)
        counts = _sum_counts(nonfinite)
        figures.update(diff_thd=self.diff_thd, pct_thd=self.pct_thd, max_diff_hd=self.max_diff_hd,
                       floor=self.floor, **counts)
        any_nonfinite = any(counts.values())
        diff, rdiff = self.rdiff(a, e)
        bad = rdiff > self.diff_thd
        if any_nonfinite:
            finite = torch.isfinite(a) & torch.isfinite(e)
            diff = torch.where(finite, diff, 0.0)
            bad &= finite
        per_rank = _rank_figures(bounds, nonfinite, diff, bad, rdiff, locate)
        figures.update(_totals(per_rank))
        n_bad, numel = figures["n_bad"], figures["numel"]
        threshold = round(self.pct_thd * numel)
        worst_rdiff = figures["worst"] if n_bad else 0.0
        figures.update(threshold=threshold, margin=n_bad - threshold, worst_rdiff=worst_rdiff)
        if any_nonfinite:
            extras = _nonfinite_lines(a, e, locate) + _rank_lines(per_rank)
            return self._verdict(False, "nonfinite", _join(_nonfinite_text(counts), extras), figures, per_rank)
        first, worst = _listed(bad, rdiff, self.max_show)
        figures["worst_at"] = tuple(locate(worst[0])["at"]) if worst else None
        figures["first_bad"] = _points(first, a, e, diff, locate, "rdiff", rdiff)
        figures["worst_bad"] = _points(worst, a, e, diff, locate, "rdiff", rdiff)
        reasons = (["budget"] if n_bad > threshold else []) + (["cap"] if worst_rdiff >= self.max_diff_hd else [])
        figures["reasons"] = reasons
        if not reasons:
            return self._verdict(True, None, "", figures, per_rank, _pooled_note(per_rank, True))
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
        extras += _point_lines(f"worst {len(worst)} mismatches (by rdiff)", figures["worst_bad"], "rdiff")
        extras += _rank_lines(per_rank)
        if self.rank_axis:
            extras += _permutation_hint(a, e, per_rank, figures)
        kind = "budget+cap" if len(reasons) == 2 else reasons[0]
        return self._verdict(False, kind, _join(reference, extras), figures, per_rank)


def ratio_reldiff(diff_thd: float = 0.01, pct_thd: float = 0.05, max_diff_hd: float = float("inf"),
                  max_show: int = 10, valid_rows: int | None = None, valid_axis: int = 0,
                  zero_tail: bool = False, *, rank_axis: bool = False) -> RatioReldiff:
    return RatioReldiff(diff_thd, pct_thd, max_diff_hd, max_show, valid_rows, valid_axis, zero_tail,
                        rank_axis=rank_axis)


# -- mapped_pool_ratio_allclose (§9) -----------------------------------------------------------


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _unchanged_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rows of `[n, W]` tensors holding the same bits (a NaN left in place is unchanged).

    Bitwise, as "did this side write the row" is about storage; viewed as int64 words where
    the row's bytes allow it, so a whole pool is compared in a few milliseconds.
    """
    bx, by = x.contiguous().view(_BITS[x.element_size()]), y.contiguous().view(_BITS[y.element_size()])
    if bx.shape[1] * bx.element_size() % 8 == 0:
        bx, by = bx.view(torch.int64), by.view(torch.int64)
    return (bx == by).all(dim=1)


# which side's bits differ from the initial pool; index = actual_changed + 2 * expected_changed
_SIDES = ("neither", "actual", "expected", "both")


class MappedPoolRatioAllclose(Comparator):
    """A block-major pool compared only where the step's slot mapping wrote (§9.2).

    Unmapped rows must be exactly equal (`==`); mapped rows of all ranks share one
    ratio_allclose budget. `initial_name` names the `inputs` entry holding the pool before the
    step (optional, diagnostics only: it never changes the verdict).
    """

    def __init__(self, mapping_name: str, *, mapping_shape: Sequence[int], block_size: int,
                 leading_rank_axis: bool = False, pool_name: str = "pool", atol: float | None = None,
                 rtol: float | None = None, max_error_ratio: float = 0.005, initial_name: str | None = None):
        mapping_shape = tuple(mapping_shape)
        if not mapping_shape or any(d <= 0 for d in mapping_shape):
            raise ValueError(f"mapping_shape must contain positive dimensions, got {mapping_shape}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if leading_rank_axis and len(mapping_shape) < 2:
            raise ValueError("leading_rank_axis requires mapping_shape to include a rank axis "
                             f"and at least one mapped-item axis, got {mapping_shape}")
        self.numeric = RatioAllclose(atol=atol, rtol=rtol, max_error_ratio=max_error_ratio)
        self.mapping_name, self.mapping_shape, self.block_size = mapping_name, mapping_shape, block_size
        self.leading_rank_axis, self.pool_name, self.initial_name = leading_rank_axis, pool_name, initial_name
        self.__name__ = (f"mapped_pool_ratio_allclose(mapping={mapping_name}, shape={mapping_shape}, "
                         f"block_size={block_size}, leading_rank_axis={leading_rank_axis}, "
                         f"atol={atol}, rtol={rtol}, max_error_ratio={max_error_ratio})")

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        inputs = inputs or {}
        mismatch = _mismatch_verdict(self, actual, expected, f"{self.pool_name} ")
        if mismatch:
            return mismatch
        figures = {**_base_figures(actual), "pool": self.pool_name, "mapping": self.mapping_name}
        fail = lambda kind, text: self._verdict(False, kind, text, figures)  # noqa: E731
        ranked, bs, name = self.leading_rank_axis, self.block_size, self.mapping_name
        block_axis = 2 if ranked else 1
        if actual.dim() < block_axis + 1 or actual.shape[block_axis] != bs:
            layout = "[ranks, blocks, block_size, ...]" if ranked else "[blocks, block_size, ...]"
            return fail("layout", f"    expected block-major {self.pool_name} layout {layout} with "
                                  f"block_size={bs}, got {tuple(actual.shape)}")
        mapping = inputs.get(name)
        if mapping is None:
            return fail("config", f"    compare_fn misconfigured: missing input '{name}'")
        if mapping.dtype not in _INTEGER_DTYPES:
            return fail("mapping", f"    '{name}' must have an integer dtype, got {mapping.dtype}")
        if tuple(mapping.shape) != self.mapping_shape:
            return fail("mapping", f"    '{name}' must have shape {self.mapping_shape}, got {tuple(mapping.shape)}")
        n_ranks = self.mapping_shape[0] if ranked else 1
        if ranked and actual.shape[0] != n_ranks:
            return fail("layout", f"    leading rank count of {self.pool_name} must be {n_ranks}, got {actual.shape[0]}")
        rows = actual.shape[block_axis - 1] * bs
        a_rows = actual.cpu().reshape(n_ranks * rows, -1)
        e_rows = expected.cpu().reshape(n_ranks * rows, -1)
        width = a_rows.shape[1]
        m = mapping.cpu().to(torch.int64).reshape(n_ranks, -1)
        figures.update(row_width=width, rows_per_rank=rows)

        def loc(r: int, i: int) -> str:
            return f"[{r}, {i}]" if ranked else f"[{i}]"

        negative = (m < -1).nonzero()
        if len(negative):
            r, i = negative[0].tolist()
            return fail("mapping", f"    '{name}'{loc(r, i)}={int(m[r, i])} is invalid; only -1 is a negative sentinel")
        valid = m >= 0
        outside = (valid & (m >= rows)).nonzero()
        if len(outside):
            r, i = outside[0].tolist()
            return fail("mapping", f"    '{name}'{loc(r, i)}={int(m[r, i])} is outside physical row range [0, {rows})")
        # key = rank * rows + physical row, in row-major (rank, item) order
        keys = (torch.arange(n_ranks).unsqueeze(1) * rows + m)[valid]
        items = torch.arange(m.shape[1]).expand_as(m)[valid]
        sorted_keys = keys.sort().values
        dup_keys = sorted_keys[1:][sorted_keys[1:] == sorted_keys[:-1]].unique()
        if len(dup_keys):
            r, row = divmod(int(dup_keys[0]), rows)
            dup_items = (m[r] == row).nonzero().flatten().tolist()
            figures.update(duplicate_rows=len(dup_keys), first_duplicate={"rank": r, "row": row, "items": dup_items})
            where = f" on rank {r}" if ranked else ""
            text = (f"    '{name}' contains duplicate physical row {row}{where}\n"
                    f"    items of '{name}'{'[' + str(r) + ']' if ranked else ''} mapping to it: {dup_items}; "
                    f"{len(dup_keys)} duplicated row(s) in all (a fixture error, not the implementation's)")
            return fail("mapping", text)
        written = torch.zeros(n_ranks * rows, dtype=torch.bool)
        written[keys] = True
        item_of = torch.full((n_ranks * rows,), -1, dtype=torch.int64)
        item_of[keys] = items
        initial = self._initial(inputs, actual, figures)
        init_rows = initial.cpu().reshape(n_ranks * rows, -1) if initial is not None else None

        stray_keys = (~written & ~(a_rows == e_rows).all(dim=1)).nonzero().flatten()
        stray = self._strays(stray_keys, a_rows, e_rows, init_rows, n_ranks, rows, figures)

        written_keys = written.nonzero().flatten()  # (rank, row) row-major: each rank contiguous
        per_rank_rows = torch.bincount(written_keys // rows, minlength=n_ranks).tolist()
        starts = [sum(per_rank_rows[:r]) for r in range(n_ranks + 1)]
        bounds = [(starts[r], starts[r + 1]) for r in range(n_ranks)]
        figures["n_written_rows"] = len(written_keys)
        a_g, e_g = a_rows[written_keys], e_rows[written_keys]
        nonfinite_refs = []
        if a_g.is_floating_point():
            for side, t in (("actual", a_g), ("expected", e_g)):
                n = int((~torch.isfinite(t)).sum())
                figures[f"nonfinite_mapped_{side}"] = n
                if n:
                    nonfinite_refs.append(f"    {side} mapped rows in {self.pool_name} from '{name}' "
                                          f"contain {n} non-finite value(s)")
        unwritten = None
        if init_rows is not None and len(written_keys):
            i_g = init_rows[written_keys]
            unwritten = _unchanged_rows(a_g, i_g) & ~_unchanged_rows(e_g, i_g)
            figures["unwritten_rows"] = int(unwritten.sum())

        if len(written_keys):
            locate = self._locator(written_keys, item_of, rows, width, actual.shape[block_axis + 1:])
            eff_atol, eff_rtol = self.numeric.effective(rtol, atol)
            j = self.numeric._judge(a_g.to(torch.float32), e_g.to(torch.float32), eff_atol, eff_rtol, bounds,
                                    locate, located=True)
            figures.update(j.figures)
            per_rank = j.per_rank
        else:
            j = _Judgement(True, None, "", [], {}, [])
            figures.update(numel=0, n_bad=0)
            per_rank = [RankFigures(rank=r) for r in range(n_ranks)]
        self._rank_pool_figures(per_rank, per_rank_rows, stray, unwritten, bounds)

        # the reference reports the first failing check only: stray rows, non-finite, numeric
        if stray["count"]:
            kind, reference = "stray", stray["reference"]
        elif nonfinite_refs:
            kind, reference = "nonfinite", nonfinite_refs[0]
        elif not j.passed:
            kind, reference = j.kind, f"    mapped rows in {self.pool_name} from '{name}':\n{j.reference}"
        else:
            return self._verdict(True, None, "", figures, per_rank, _pooled_note(per_rank, True))
        extras = list(stray["lines"])
        if kind == "nonfinite":
            extras.append(j.reference)  # the per-side NaN / Inf counts of the mapped rows
        elif not j.passed and j.kind != kind:
            extras += [f"    mapped rows in {self.pool_name} from '{name}' (also failing):", j.reference]
        extras += j.extras + _rank_lines(per_rank)
        if unwritten is not None and figures["unwritten_rows"]:
            extras.append(f"    {figures['unwritten_rows']} mapped row(s) still hold their initial value in the "
                          "actual pool but not in the golden (writes the implementation skipped)")
        return self._verdict(False, kind, _join(reference, extras), figures, per_rank)

    def _initial(self, inputs: Mapping[str, torch.Tensor], actual: torch.Tensor, figures: dict) -> torch.Tensor | None:
        initial = inputs.get(self.initial_name) if self.initial_name else None
        figures["initial"] = initial is not None
        if initial is not None and (initial.shape != actual.shape or initial.dtype != actual.dtype):
            figures["initial"] = (f"ignored: {tuple(initial.shape)} {initial.dtype} vs the pool's "
                                  f"{tuple(actual.shape)} {actual.dtype}")
            return None
        return initial

    def _strays(self, stray_keys: torch.Tensor, a_rows: torch.Tensor, e_rows: torch.Tensor,
                init_rows: torch.Tensor | None, n_ranks: int, rows: int, figures: dict) -> dict[str, Any]:
        """Every changed unmapped row: counts per rank, first examples, which side changed it."""
        count = len(stray_keys)
        figures["stray_rows"] = count
        out: dict[str, Any] = {"count": count, "lines": [], "reference": "", "per_rank": [0] * n_ranks,
                               "examples": [[] for _ in range(n_ranks)], "sides": None}
        if not count:
            figures.update(stray_examples=[], stray_by_side=None)
            return out
        a_s, e_s = a_rows[stray_keys], e_rows[stray_keys]
        rank_of = stray_keys // rows
        out["per_rank"] = torch.bincount(rank_of, minlength=n_ranks).tolist()
        side = None
        if init_rows is not None:
            i_s = init_rows[stray_keys]
            side = (~_unchanged_rows(a_s, i_s)).long() + 2 * (~_unchanged_rows(e_s, i_s)).long()
            by = torch.bincount(rank_of * 4 + side, minlength=4 * n_ranks).view(n_ranks, 4).tolist()
            out["sides"] = [dict(zip(_SIDES, b)) for b in by]
            figures["stray_by_side"] = dict(zip(_SIDES, torch.bincount(side, minlength=4).tolist()))
        else:
            figures["stray_by_side"] = None
        figures["stray_nan"] = {"actual": int(torch.isnan(a_s).sum()), "expected": int(torch.isnan(e_s).sum())}
        start = 0
        for r in range(n_ranks):  # one iteration per rank (P is a handful): its first few strays
            stop = start + out["per_rank"][r]
            for g in range(start, min(stop, start + MAX_EXAMPLES)):
                row = int(stray_keys[g]) - r * rows
                ex = {"rank": r, "block": row // self.block_size, "intra": row % self.block_size, "row": row,
                      "changed_values": int((a_s[g] != e_s[g]).sum())}
                if side is not None:
                    ex["changed_side"] = _SIDES[int(side[g])]
                out["examples"][r].append(ex)
            start = stop
        first_examples = [ex for r in range(n_ranks) for ex in out["examples"][r]]
        figures["stray_examples"] = first_examples[:MAX_EXAMPLES]
        first = out["examples"][int(rank_of[0])][0]
        rank_detail = f" rank={first['rank']}" if self.leading_rank_axis else ""
        out["reference"] = (f"    unmapped physical {self.pool_name} row changed:{rank_detail} "
                            f"row={first['row']} changed_values={first['changed_values']} mapping='{self.mapping_name}'")
        per = ", ".join(f"rank {r}: {c}" for r, c in enumerate(out["per_rank"]))
        lines = [f"    {count} unmapped row(s) changed in all ({per})"]
        for ex in first_examples[:MAX_EXAMPLES]:
            side_text = f" changed by {ex['changed_side']}" if "changed_side" in ex else ""
            lines.append(f"      (rank={ex['rank']}, block={ex['block']}, intra={ex['intra']}) "
                         f"row={ex['row']} changed_values={ex['changed_values']}{side_text}")
        if figures["stray_by_side"]:
            s = figures["stray_by_side"]
            lines.append(f"    vs the initial pool: actual changed {s['actual']}, golden changed {s['expected']}, "
                         f"both {s['both']}, neither {s['neither']} (both sides as before, e.g. a NaN kept in place)")
        out["lines"] = lines
        return out

    def _locator(self, written_keys: torch.Tensor, item_of: torch.Tensor, rows: int, width: int,
                 trailing: Sequence[int]) -> Locate:
        keys, items, bs, ranked = written_keys.tolist(), item_of, self.block_size, self.leading_rank_axis

        def pool_point(flat: int) -> dict[str, Any]:
            g, col = divmod(flat, width)
            key = keys[g]
            r, row = divmod(key, rows)
            block, intra = divmod(row, bs)
            at = ((r,) if ranked else ()) + (block, intra) + _unravel(col, trailing)
            return {"at": at, "rank": r, "block": block, "intra": intra, "item": int(items[key]), "col": col}

        return pool_point

    @staticmethod
    def _rank_pool_figures(per_rank: list[RankFigures], mapped_rows: Sequence[int], stray: Mapping[str, Any],
                           unwritten: torch.Tensor | None, bounds: Sequence[tuple[int, int]]) -> None:
        for rf in per_rank:
            r = rf.rank
            rf.mapped_rows = mapped_rows[r]
            rf.stray_rows = stray["per_rank"][r]
            rf.stray_examples = stray["examples"][r]
            rf.stray_by_side = stray["sides"][r] if stray["sides"] else None
            if unwritten is not None:
                s, stop = bounds[r]
                rf.unwritten_rows = int(unwritten[s:stop].sum())


def mapped_pool_ratio_allclose(mapping_name: str, *, mapping_shape: Sequence[int], block_size: int,
                               leading_rank_axis: bool = False, pool_name: str = "pool",
                               atol: float | None = None, rtol: float | None = None,
                               max_error_ratio: float = 0.005,
                               initial_name: str | None = None) -> MappedPoolRatioAllclose:
    return MappedPoolRatioAllclose(mapping_name, mapping_shape=mapping_shape, block_size=block_size,
                                   leading_rank_axis=leading_rank_axis, pool_name=pool_name, atol=atol,
                                   rtol=rtol, max_error_ratio=max_error_ratio, initial_name=initial_name)


# -- topk_pair_compare (§11.1) -----------------------------------------------------------------


class TopkPairCompare(Comparator):
    """Index mismatches are legal where the actual scores stay ordered around them (exact)."""

    def __init__(self, vals_name: str, *, dim: int = -1, descending: bool = True, max_show: int = 10,
                 rank_axis: bool = False):
        self.vals_name, self.dim, self.descending, self.max_show, self.rank_axis = (
            vals_name, dim, descending, max_show, rank_axis)
        self.__name__ = "topk_pair_compare"

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        actual_outputs = actual_outputs or {}
        figures = _base_figures(actual)
        if self.vals_name not in actual_outputs:
            return self._verdict(False, "config", (f"    compare_fn misconfigured: vals_name='{self.vals_name}' "
                                                   f"not found in actual outputs={list(actual_outputs)}"), figures)
        a_idx, e_idx = actual.cpu(), expected.cpu()
        a_vals = actual_outputs[self.vals_name].cpu().to(torch.float32)
        if a_idx.shape != e_idx.shape:
            return self._verdict(False, "shape", f"    idx shape mismatch: {tuple(a_idx.shape)} vs {tuple(e_idx.shape)}",
                                 figures)
        if a_idx.dtype != e_idx.dtype:
            return self._verdict(False, "dtype", f"    idx dtype mismatch: {a_idx.dtype} vs {e_idx.dtype}", figures)
        if a_idx.shape != a_vals.shape:
            return self._verdict(False, "shape", (f"    idx/vals shape mismatch: idx={tuple(a_idx.shape)} "
                                                  f"vs vals={tuple(a_vals.shape)}"), figures)
        ndim = a_idx.dim()
        dim_pos = self.dim if self.dim >= 0 else self.dim + ndim
        if not 0 <= dim_pos < ndim:
            return self._verdict(False, "config", f"    dim={self.dim} out of range for shape {tuple(a_idx.shape)}",
                                 figures)
        a2 = a_idx.movedim(dim_pos, -1).reshape(-1, a_idx.shape[dim_pos])
        e2 = e_idx.movedim(dim_pos, -1).reshape(-1, a_idx.shape[dim_pos])
        v2 = a_vals.movedim(dim_pos, -1).reshape(-1, a_idx.shape[dim_pos])
        n_rows, k = a2.shape
        mismatch = a2 != e2
        # a mismatch at i is legal iff the actual scores stay ordered with both neighbours
        breaks_order = torch.zeros_like(mismatch)
        if k >= 2:
            pair_broken = (v2[:, :-1] < v2[:, 1:]) if self.descending else (v2[:, :-1] > v2[:, 1:])
            pair_broken |= torch.isnan(v2[:, :-1]) | torch.isnan(v2[:, 1:])  # NaN is never ordered
            breaks_order[:, 1:] |= pair_broken
            breaks_order[:, :-1] |= pair_broken
        fail_mask = mismatch & breaks_order
        n_fail = int(fail_mask.sum())
        figures.update(numel=a_idx.numel(), n_rows=n_rows, k=k, n_mismatch=int(mismatch.sum()), n_bad=n_fail,
                       nan_actual_vals=int(torch.isnan(a_vals).sum()))
        per_rank = self._per_rank(fail_mask, a_idx.shape, dim_pos)
        leading = [d for d in range(ndim) if d != dim_pos]
        lead_shape = [a_idx.shape[d] for d in leading]

        def coord(row: int, pos: int) -> list[int]:
            full = [0] * ndim
            for axis, c in zip(leading, _unravel(row, lead_shape)):
                full[axis] = c
            full[dim_pos] = pos
            return full

        fail_rc = fail_mask.nonzero()[: self.max_show].tolist()
        figures["first_bad"] = [
            {"at": coord(r, p), "actual_idx": int(a2[r, p]), "expected_idx": int(e2[r, p]),
             "actual_score": float(v2[r, p]), "window": v2[r, max(0, p - 1): min(k, p + 2)].tolist()}
            for r, p in fail_rc
        ]
        if not n_fail:
            return self._verdict(True, None, "", figures, per_rank)
        order = "descending" if self.descending else "ascending"
        lines = [f"    top-k idx mismatch via '{self.vals_name}' (dim={self.dim} order={order}): "
                 f"{n_fail} position(s) where a_vals breaks {order} order at the mismatch"]
        for (r, p), pt in zip(fail_rc, figures["first_bad"]):
            lo, hi = max(0, p - 1), min(k, p + 2)
            window = ", ".join(f"{v:.6g}" for v in pt["window"])
            lines.append(f"      [{','.join(str(c) for c in pt['at'])}] actual_idx={pt['actual_idx']} "
                         f"expected_idx={pt['expected_idx']} actual_score={pt['actual_score']:.6g} "
                         f"actual_vals[{lo}:{hi}]=[{window}]")
        if n_fail > self.max_show:
            lines.append(f"      ... and {n_fail - self.max_show} more")
        extras = [f"    {figures['n_mismatch']} position-wise idx difference(s) in all, {n_fail} illegal"]
        extras += _rank_lines(per_rank)
        return self._verdict(False, "mismatch", _join("\n".join(lines), extras), figures, per_rank)

    def _per_rank(self, fail_mask: torch.Tensor, shape: Sequence[int], dim_pos: int) -> list[RankFigures]:
        if self.rank_axis and dim_pos != 0:
            per = fail_mask.view(shape[0], -1)
            return [RankFigures(rank=r, numel=per.shape[1], n_bad=int(n)) for r, n in enumerate(per.sum(dim=1).tolist())]
        return [RankFigures(rank=0, numel=fail_mask.numel(), n_bad=int(fail_mask.sum()))]


def topk_pair_compare(vals_name: str, *, dim: int = -1, descending: bool = True, max_show: int = 10,
                      rank_axis: bool = False) -> TopkPairCompare:
    return TopkPairCompare(vals_name, dim=dim, descending=descending, max_show=max_show, rank_axis=rank_axis)


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
        mismatch = _mismatch_verdict(self, actual, expected)
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
        figures = {**_base_figures(actual), **summary, "nan_actual": nan, "inf_actual": inf}
        per_rank = []
        for r, (s, stop) in enumerate(_bounds(a, self.rank_axis)):  # one summary per rank (a handful)
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
        bounds, locate = _bounds(a64, self.rank_axis), _plain_locator(a64.shape)
        nonfinite = _nonfinite_by_rank(a64, e64, bounds)
        finite = torch.isfinite(a64) & torch.isfinite(e64)
        diff = torch.where(finite, (a64 - e64).abs(), 0.0)
        per_rank = _rank_figures(bounds, nonfinite, diff, bad, diff, locate)
        figures.update(_sum_counts(nonfinite), **_totals(per_rank))
        n_bad = figures["n_bad"]
        first, _ = _listed(bad, None, self.max_show)
        figures["first_bad"] = _points(first, a64, e64, diff, locate)
        if not n_bad:
            return self._verdict(True, None, "", figures, per_rank)
        extras = _rank_lines(per_rank)
        if self.rank_axis:
            extras += _permutation_hint(a64, e64, per_rank, figures)
        flat_a, flat_e = a.reshape(-1), e.reshape(-1)
        shown = [(i, flat_a[i].item(), flat_e[i].item()) for i in first]
        return self._verdict(False, "mismatch", _join(reference(shown), extras), figures, per_rank)


class Exact(_MaskComparator):
    """Every element equal (`==`): the reference's allclose(rtol=0, atol=0) for collectives.

    NaN never equals NaN (poison must not appear), equal infinities and ±0 compare equal.
    """

    def __init__(self, *, max_show: int = 20, rank_axis: bool = False):
        self.max_show, self.rank_axis = max_show, rank_axis
        self.__name__ = "exact"

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        mismatch = _mismatch_verdict(self, actual, expected)
        if mismatch:
            return mismatch
        a, e = actual.cpu(), expected.cpu()
        figures = _base_figures(actual)
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
        mismatch = _mismatch_verdict(self, actual, expected)
        if mismatch:
            return mismatch
        eff_rtol = rtol if self.rtol is None else self.rtol
        eff_atol = atol if self.atol is None else self.atol
        a, e = actual.cpu(), expected.cpu()
        figures = {**_base_figures(actual), "rtol": eff_rtol, "atol": eff_atol}
        if a.numel() == 0:
            return self._verdict(True, None, "", {**figures, "numel": 0, "n_bad": 0})
        bad = ~torch.isclose(a, e, rtol=eff_rtol, atol=eff_atol)

        def reference(shown: list) -> str:
            lines = [f"    [{i}] actual={x}, expected={y}" for i, x, y in shown]
            return (f"    Mismatched elements: {int(bad.sum())}/{a.numel()}  rtol={eff_rtol} atol={eff_atol}\n"
                    f"    first {len(lines)} mismatches:\n" + "\n".join(lines))

        return self._mask_verdict(a, e, bad, reference, figures)


# -- dispatch over a run's outputs (§6.2) ------------------------------------------------------


def compare_outputs(outputs: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor], *,
                    rtol: float = 1e-5, atol: float = 1e-5, compare_fn: Mapping[str, Callable] | None = None,
                    inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, Verdict]:
    """One Verdict per device output, in `outputs` order (a name missing in `golden`: KeyError).

    Outputs without a comparator get `AllClose(rtol, atol)`; a foreign comparator (a plain
    callable with the reference convention) is wrapped into a Verdict without figures.
    """
    compare_fn, inputs = compare_fn or {}, inputs or {}
    verdicts = {}
    for name, actual_tensor in outputs.items():
        actual, expected = actual_tensor.cpu(), golden[name].cpu()
        fn = compare_fn.get(name)
        context = dict(actual_outputs=outputs, expected_outputs=golden, inputs=inputs, rtol=rtol, atol=atol)
        if fn is None:
            verdicts[name] = AllClose(rtol, atol).evaluate(actual, expected, **context)
        elif isinstance(fn, Comparator):
            verdicts[name] = fn.evaluate(actual, expected, **context)
        else:
            ok, detail = fn(actual, expected, **context)
            verdicts[name] = Verdict(passed=bool(ok), label=getattr(fn, "__name__", "custom"),
                                     detail="" if ok else detail, kind=None if ok else "custom",
                                     category=None if ok else "implementation", figures=_base_figures(actual))
    return verdicts


def validate_golden(outputs: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor],
                    rtol: float = 1e-5, atol: float = 1e-5, compare_fn: Mapping[str, Callable] | None = None,
                    inputs: Mapping[str, torch.Tensor] | None = None) -> None:
    """The reference's validate_golden: print one line per output, raise AssertionError on failures."""
    compare_fn = compare_fn or {}
    verdicts = compare_outputs(outputs, golden, rtol=rtol, atol=atol, compare_fn=compare_fn, inputs=inputs)
    failures = {}
    for name, v in verdicts.items():
        t = outputs[name]
        where = f"shape={tuple(t.shape)} dtype={t.dtype}"
        if name in compare_fn:
            print(f"[RUN]   '{name}' {'PASS' if v.passed else 'FAIL'}  {where} ({v.label})")
            if not v.passed:
                failures[name] = f"  '{name}' FAIL ({v.label})  {where}\n{v.detail}"
        else:
            print(f"[RUN]   '{name}' {'PASS' if v.passed else 'FAIL'}  {where}")
            if not v.passed:
                failures[name] = f"  '{name}' FAIL  {where}\n{v.detail}"
    if failures:
        raise AssertionError(f"Output(s) does not match golden: {list(failures)}\n" + "\n".join(failures.values()))


# -- from the layers' check data ---------------------------------------------------------------


def build_comparator(check: Check, *, mapping_shape: Sequence[int], leading_rank_axis: bool) -> Comparator:
    """The comparator a layer's check describes (§12): pools by their mapping, x_out by ratio_reldiff.

    Pools get `initial_name=initial_key(check.output)` so a pre-step snapshot in `inputs` is used.
    """
    if isinstance(check, PoolCheck):
        return mapped_pool_ratio_allclose(
            check.mapping, mapping_shape=tuple(mapping_shape), block_size=check.block_size,
            leading_rank_axis=leading_rank_axis, pool_name=check.pool_name, atol=check.atol, rtol=check.rtol,
            max_error_ratio=check.max_error_ratio, initial_name=initial_key(check.output))
    if isinstance(check, RelDiffCheck):
        return ratio_reldiff(check.diff_thd, check.pct_thd, check.max_diff_hd, rank_axis=leading_rank_axis)
    if isinstance(check, StageCheck):  # the scopes' and bisect's stage-level checks (§12.5)
        from .stage_comparators import build_stage_comparator  # imported here: it builds on this module

        return build_stage_comparator(check, leading_rank_axis=leading_rank_axis)
    raise TypeError(f"no comparator for check {check!r}")


def build_compare_fn(checks: Sequence[Check], *, mapping_shape: Sequence[int],
                     leading_rank_axis: bool) -> dict[str, Comparator]:
    """`compare_fn` for validate_golden / compare_outputs from a layer's checks."""
    return {c.output: build_comparator(c, mapping_shape=mapping_shape, leading_rank_axis=leading_rank_axis)
            for c in checks}
