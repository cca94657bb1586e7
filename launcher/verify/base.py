"""What every comparator shares: the `Verdict` it returns, the `Comparator` base class with the
reference call convention (§6.1), and the figure helpers the comparator families build on
(shape/dtype checks, the valid prefix, per-rank figures, located points, the rank-permutation
hint). Pure tensor code on CPU, no torch.distributed, no layer code.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

INITIAL_PREFIX = "initial:"
MAX_EXAMPLES = 8  # stray rows / non-finite coordinates listed per side or per rank
PERMUTATION_MAX_RANKS = 8  # the rank-permutation hint costs P full passes over the tensor
PERMUTATION_FACTOR = 0.25  # "far better": mean |diff| against r' below this share of against r

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
class Judgement:
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


def join_detail(reference: str, extras: Sequence[str]) -> str:
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


def base_figures(actual: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(actual.shape), "dtype": str(actual.dtype)}


def mismatch_verdict(cmp: Comparator, actual: torch.Tensor, expected: torch.Tensor,
                      prefix: str = "") -> Verdict | None:
    """A FAIL on unequal shapes, then dtypes (§14.9); `prefix` names the tensor in the message."""
    if actual.shape == expected.shape and actual.dtype == expected.dtype:
        return None
    figures = {**base_figures(actual), "expected_shape": list(expected.shape), "expected_dtype": str(expected.dtype)}
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


def prepare(cmp: Comparator, actual: torch.Tensor, expected: torch.Tensor, valid_rows: int | None,
             valid_axis: int, zero_tail: bool) -> tuple[Verdict | None, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Shape/dtype check, valid prefix, fp32 CPU copies (a 0-dim tensor becomes shape (1,))."""
    figures = base_figures(actual)
    mismatch = mismatch_verdict(cmp, actual, expected)
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


def pooled_note(per_rank: Sequence[RankFigures], passed: bool) -> list[str]:
    bad = [r for r in per_rank if r.n_bad]
    if not passed or len(per_rank) < 2 or not bad:
        return []
    ranks = ", ".join(f"rank {r.rank}: {r.n_bad}/{r.numel}" for r in bad)
    return [f"    within the pooled budget, bad points on {ranks}"]


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def rank_bounds(t: torch.Tensor, rank_axis: bool) -> list[tuple[int, int]]:
    """Each rank's [start, stop) along the leading axis (one 'rank' when not ranked)."""
    if rank_axis:
        return [(r, r + 1) for r in range(t.shape[0])]
    return [(0, t.shape[0])]


def nonfinite_by_rank(a: torch.Tensor, e: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[dict[str, int]]:
    out = []
    for s, stop in bounds:  # one iteration per rank (P is a handful), each on its own slice
        a_r, e_r = a[s:stop], e[s:stop]
        out.append({
            "nan_actual": int(torch.isnan(a_r).sum()), "inf_actual": int(torch.isinf(a_r).sum()),
            "nan_expected": int(torch.isnan(e_r).sum()), "inf_expected": int(torch.isinf(e_r).sum()),
        })
    return out


def sum_counts(per_rank: Sequence[Mapping[str, int]]) -> dict[str, int]:
    keys = ("nan_actual", "inf_actual", "nan_expected", "inf_expected")
    return {k: sum(c[k] for c in per_rank) for k in keys}


def nonfinite_text(c: Mapping[str, int]) -> str:
    return ("    illegal values in comparison: "
            f"actual: NaN={c['nan_actual']} Inf={c['inf_actual']}; "
            f"expected: NaN={c['nan_expected']} Inf={c['inf_expected']}")


Locate = Callable[[int], dict[str, Any]]


def plain_locator(shape: Sequence[int]) -> Locate:
    return lambda flat: {"at": unravel(flat, shape)}


_POOL_LOCATION = ("rank", "block", "intra", "item", "col")


def _where(point: Mapping[str, Any]) -> str:
    """A point's location: pool points by rank/block/intra/item/col, others by coordinate."""
    if "block" in point:
        return " ".join(f"{k}={point[k]}" for k in _POOL_LOCATION)
    return f"at {tuple(point['at'])}"


def nonfinite_lines(a: torch.Tensor, e: torch.Tensor, locate: Locate) -> list[str]:
    lines = []
    for side, t in (("actual", a), ("expected", e)):
        flat = (~torch.isfinite(t)).flatten().nonzero().flatten()[:MAX_EXAMPLES].tolist()
        if flat:
            vals = t.flatten()
            pts = ", ".join(f"{_where(locate(i))}={float(vals[i])}" for i in flat)
            lines.append(f"    first non-finite {side} values: {pts}")
    return lines


def rank_figures(bounds: Sequence[tuple[int, int]], nonfinite: Sequence[Mapping[str, int]],
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


def pooled_totals(per_rank: Sequence[RankFigures]) -> dict[str, Any]:
    """Pooled figures from the per-rank ones (ties resolve to the lowest rank, as a flat argmax)."""
    figures: dict[str, Any] = {"numel": sum(r.numel for r in per_rank), "n_bad": sum(r.n_bad for r in per_rank)}
    with_values = [r for r in per_rank if r.numel]
    top = max(with_values, key=lambda r: r.max_abs_diff, default=None)
    figures["max_abs_diff"] = top.max_abs_diff if top else None
    figures["max_abs_diff_at"] = top.max_abs_diff_at if top else None
    figures["worst"] = max((r.worst for r in with_values), default=None)
    figures["ranks_with_bad"] = [r.rank for r in per_rank if r.n_bad]
    return figures


def point_figures(indices: Sequence[int], a: torch.Tensor, e: torch.Tensor, diff: torch.Tensor, locate: Locate,
            measure_name: str | None = None, measure: torch.Tensor | None = None) -> list[dict[str, Any]]:
    fa, fe, fd = a.reshape(-1), e.reshape(-1), diff.view(-1)
    points = []
    for i in indices:
        p = {**locate(i), "flat": i, "actual": float(fa[i]), "expected": float(fe[i]), "diff": float(fd[i])}
        if measure_name:
            p[measure_name] = float(measure.view(-1)[i])
        points.append(p)
    return points


def point_lines(title: str, points: Sequence[Mapping[str, Any]], measure_name: str) -> list[str]:
    if not points:
        return []
    lines = [f"    {title}:"]
    for p in points:
        lines.append(f"      {_where(p)} actual={p['actual']:.8g}, expected={p['expected']:.8g}, "
                     f"diff={p['diff']:.4g}, {measure_name}={p[measure_name]:.4g}")
    return lines


def listed_points(bad: torch.Tensor, score: torch.Tensor | None, k: int) -> tuple[list[int], list[int]]:
    """Flat indices of the first k bad points (flat order) and of the worst k (by score)."""
    idx = bad.view(-1).nonzero().flatten()
    if score is None or not len(idx):
        return idx[:k].tolist(), []
    worst = idx[torch.topk(score.view(-1)[idx], min(k, len(idx))).indices]
    return idx[:k].tolist(), worst.tolist()


def rank_lines(per_rank: Sequence[RankFigures]) -> list[str]:
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


def permutation_hint(a: torch.Tensor, e: torch.Tensor, per_rank: list[RankFigures],
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


