"""Where a compared tensor's errors are: per-rank grids of bad points (drawn by `launcher.report.plots`).

`error_maps` reduces one compared output (stacked `[P, ...]` actual and golden, as rank 0
holds them after the gather) to small JSON-ready grids, one row per rank:

* a hidden state `[P, t, HC, D]` (ratio_reldiff checks; its axes as the check names them):
  rank x token block (lcm(decode_seq, 8) tokens: whole requests, whole 8-row token tiles), and
  rank x hc copy;
* a mapped pool `[P, NB, block, ...]` (mapped-pool checks): rank x physical block, counting
  the out-of-tolerance values of the rows the step mapped plus every changed value of a row it
  did not map (a stray write), and rank x head where the pool has a head axis wider than 1.

A point is bad by the gate's own rule (validation.md §8.2, §10.2), non-finite on either side
counting as bad; the grids say where, the comparator's verdict says whether it passes. Each
cell holds the bad count, the cell's element count and its max |diff| over finite points.
`tally` sums them into the figures a verdict's summary row shows, so that a row counts what
its detail counts.

Pure tensor code on CPU: no torch.distributed, no layer code beyond the check dataclasses, and
no drawing (the ranks compute the grids; only the launcher process draws them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from layers.contract.case import TOKEN_TILE
from layers.contract.checks import Check, PoolCheck, RelDiffCheck

from launcher.config.resolvers import row_block
from launcher.verify.ratio import ratio_reldiff



def axis_names(check: RelDiffCheck, dims: int) -> tuple[str, ...]:
    """What the axes of a compared output of `dims` axes mean after its leading rank axis: the
    check's declared `axes`, else row, axis2, ... (the integrity checks count bad points per
    unit by them)."""
    return check.axes or ("row",) + tuple(f"axis{i}" for i in range(2, dims))

_POOL_AXES = {3: ("block", "row", "channel"), 4: ("block", "row", "head", "channel")}


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().to(torch.float32)


def _grid(name: str, cols: str, cell: str, labels: Sequence, bad: torch.Tensor, numel: torch.Tensor,
          diff: torch.Tensor) -> dict[str, Any]:
    """One map: `bad`, `numel`, `max_abs_diff` as [P][n] lists (P ranks, n columns of `cols`,
    `cell` saying what one column holds)."""
    return {
        "name": name,
        "rows": "rank",
        "cols": cols,
        "cell": cell,
        "col_labels": [str(c) for c in labels],
        "bad": bad.to(torch.int64).tolist(),
        "numel": numel.to(torch.int64).tolist(),
        "max_abs_diff": diff.to(torch.float64).tolist(),
    }


def _axis_grid(bad: torch.Tensor, diff: torch.Tensor, axis: int):
    """Sum bad / max diff of a [P, ...] tensor over everything but ranks and `axis`."""
    p, n = bad.shape[0], bad.shape[axis]
    b = bad.movedim(axis, 1).reshape(p, n, -1)
    d = diff.movedim(axis, 1).reshape(p, n, -1)
    return b.sum(dim=2), torch.full((p, n), b.shape[2]), d.amax(dim=2)


def _reldiff_maps(name: str, check: RelDiffCheck, a: torch.Tensor, e: torch.Tensor, row_block: int) -> list[dict]:
    finite = torch.isfinite(a) & torch.isfinite(e)
    diff, rdiff = ratio_reldiff(check.diff_thd, check.pct_thd, check.max_diff_hd).rdiff(a, e)
    bad = (rdiff > check.diff_thd) | ~finite
    diff = torch.where(finite, diff, 0.0)
    p, t = a.shape[0], a.shape[1]
    axes = axis_names(check, a.dim())
    blocks = t // row_block
    per_block = bad.reshape(p, blocks, -1)
    maps = [_grid(
        "rank x token block", "token block", f"{row_block} tokens",
        [f"{i * row_block}-{(i + 1) * row_block - 1}" for i in range(blocks)],
        per_block.sum(dim=2), torch.full((p, blocks), per_block.shape[2]),
        diff.reshape(p, blocks, -1).amax(dim=2),
    )]
    for axis in range(2, a.dim() - 1):  # middle axes (x_out: the hc copies), never the channels
        if a.shape[axis] > 1:
            label = axes[axis - 1] if axis - 1 < len(axes) else f"axis{axis}"
            g_bad, g_n, g_diff = _axis_grid(bad, diff, axis)
            maps.append(_grid(f"rank x {label}", label, "", range(a.shape[axis]), g_bad, g_n, g_diff))
    return maps


def _pool_maps(check: PoolCheck, a: torch.Tensor, e: torch.Tensor, mapping: torch.Tensor) -> list[dict]:
    p, nb, bs = a.shape[0], a.shape[1], a.shape[2]
    rows = a.reshape(p, nb * bs, -1)
    rows_e = e.reshape(p, nb * bs, -1)
    slots = mapping.reshape(p, -1).to(torch.int64)
    mapped = torch.zeros(p, nb * bs, dtype=torch.bool)
    valid = (slots >= 0) & (slots < nb * bs)
    mapped[torch.arange(p)[:, None].expand_as(slots)[valid], slots[valid]] = True
    finite = torch.isfinite(rows) & torch.isfinite(rows_e)
    diff = torch.where(finite, (rows - rows_e).abs(), 0.0)
    out_of_tol = (diff > check.atol + check.rtol * rows_e.abs()) | ~finite
    # NaN kept in place on both sides is no change; any other difference of an unmapped row is.
    changed = (rows != rows_e) & ~(torch.isnan(rows) & torch.isnan(rows_e))
    bad = torch.where(mapped[..., None], out_of_tol, changed)
    shape = a.shape
    bad_full, diff_full = bad.reshape(shape), diff.reshape(shape)
    per_block = bad.reshape(p, nb, -1)
    maps = [_grid(
        "rank x physical block", "physical block", f"{bs} pool rows", range(nb),
        per_block.sum(dim=2), torch.full((p, nb), per_block.shape[2]), diff.reshape(p, nb, -1).amax(dim=2),
    )]
    axes = _POOL_AXES.get(a.dim() - 1, ())
    for axis in range(3, a.dim() - 1):  # a head axis between the rows and the channels
        if a.shape[axis] > 1:
            label = axes[axis - 1] if axis - 1 < len(axes) else f"axis{axis}"
            g_bad, g_n, g_diff = _axis_grid(bad_full, diff_full, axis)
            maps.append(_grid(f"rank x {label}", label, "", range(a.shape[axis]), g_bad, g_n, g_diff))
    return maps


def error_maps(name: str, check: Check, actual: torch.Tensor, expected: torch.Tensor,
               inputs: Mapping[str, torch.Tensor], seq: int = TOKEN_TILE) -> list[dict[str, Any]]:
    """The grids of one compared output (stacked [P, ...]); [] where shapes or dtypes disagree
    (the verdict already names that contract failure, and there is nothing to locate).

    `inputs` holds the stacked slot mappings of pool checks; `seq` is the decode_seq: token
    blocks are lcm(seq, 8) rows, whole requests and whole tiles (local_t is a multiple of it).
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype or actual.dim() < 3:
        return []
    a, e = _f32(actual), _f32(expected)
    if isinstance(check, PoolCheck):
        mapping = inputs[check.mapping]
        return _pool_maps(check, a, e, mapping)
    if isinstance(check, RelDiffCheck):
        return _reldiff_maps(name, check, a, e, row_block(seq))
    return []  # a focused scope's stage check: its verdict already lists the rows it saw


def tally(verdict: Mapping[str, Any], check: Check, shape: Sequence[int]) -> dict[str, Any]:
    """The figures a verdict's summary row shows (the console table, summary.json, JUnit), so
    that the row says what the detail says.

    For a layer check they count the whole tensor (`shape`, stacked `[P, ...]`) by the rule of
    the `where` grids: `n_bad` every bad point (out of tolerance, non-finite on either side, a
    changed value of a pool row the step did not map), `numel` every element (a pool's unmapped
    rows are judged too, exactly), `max_abs_diff` over the points finite on both sides. A
    passing verdict has no grids, and needs none: it has no non-finite point and no stray
    write, so its comparator's figures count the same. `worst` is the comparator's (the worst
    diff/tol or rdiff of a finite out-of-tolerance point), None where only non-finite points or
    stray writes are bad. A focused scope's stage check keeps its comparator's figures.
    """
    figures, per_rank = verdict.get("figures", {}), verdict.get("per_rank", [])
    if not isinstance(check, (PoolCheck, RelDiffCheck)):
        rows = [{"rank": r["rank"], "n_bad": r["n_bad"], "numel": r["numel"], "max_abs_diff": r["max_abs_diff"]}
                for r in per_rank]
        return {"n_bad": figures.get("n_bad"), "numel": figures.get("numel"), "max_abs_diff": figures.get("max_abs_diff"),
                "worst": figures.get("worst"), "per_rank": rows}
    grids = verdict.get("where")
    if grids:
        g = grids[0]
        rows = [{"rank": r, "n_bad": sum(g["bad"][r]), "numel": sum(g["numel"][r]), "max_abs_diff": max(g["max_abs_diff"][r])}
                for r in range(len(g["bad"]))]
    else:
        rank_numel = math.prod(shape[1:])
        rows = [{"rank": r["rank"], "n_bad": r["n_bad"], "numel": rank_numel, "max_abs_diff": r["max_abs_diff"]}
                for r in per_rank]
    n_bad = sum(r["n_bad"] for r in rows)
    diffs = [r["max_abs_diff"] for r in rows if r["max_abs_diff"] is not None]
    worst = figures.get("worst") if figures.get("n_bad") or not n_bad else None
    return {"n_bad": n_bad, "numel": math.prod(shape), "max_abs_diff": max(diffs, default=None), "worst": worst,
            "per_rank": rows}
