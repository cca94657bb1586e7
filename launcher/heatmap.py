"""Where a compared tensor's errors are: per-rank grids of bad points, and their PNG heat maps.

`error_maps` reduces one compared output (stacked `[P, ...]` actual and golden, as rank 0
holds them after the gather) to small JSON-ready grids, one row per rank:

* `x_out` `[P, t, HC, D]` (ratio_reldiff checks): rank x token block (lcm(decode_seq, 8)
  tokens: whole requests, whole 8-row token tiles), and rank x hc copy;
* a mapped pool `[P, NB, block, ...]` (mapped-pool checks): rank x physical block, counting
  the out-of-tolerance values of the rows the step mapped plus every changed value of a row it
  did not map (a stray write), and rank x head where the pool has a head axis wider than 1.

A point is bad by the gate's own rule (validation.md §8.2, §10.2), non-finite on either side
counting as bad; the grids say where, the comparator's verdict says whether it passes. Each
cell holds the bad count, the cell's element count and its max |diff| over finite points.
`write_png` draws one grid as an RGB PNG with zlib and struct alone (no plotting dependency).

Pure tensor code on CPU: no torch.distributed, no layer code beyond the check dataclasses.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from layers.contract.checks import Check, PoolCheck, RelDiffCheck

from launcher.verify.ratio import ratio_reldiff

TOKEN_TILE = 8  # the token axis is padded and split in 8-row tiles (layers.contract.case)
_AXES = {"x_out": ("token", "hc", "channel")}
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
    axes = _AXES.get(name, ("row",) + tuple(f"axis{i}" for i in range(2, a.dim())))
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
        return _reldiff_maps(name, check, a, e, math.lcm(seq, TOKEN_TILE))
    return []  # a focused scope's stage check: its verdict already lists the rows it saw


# -- PNG ---------------------------------------------------------------------------------------

_EMPTY = (236, 236, 236)  # no bad point in the cell
_RANK_GAP = (255, 255, 255)


def _ramp(x: float) -> tuple[int, int, int]:
    """0 < x <= 1 -> light yellow to dark red (more bad points, darker)."""
    stops = ((255, 237, 160), (254, 178, 76), (240, 59, 32), (128, 0, 38))
    pos = x * (len(stops) - 1)
    i = min(int(pos), len(stops) - 2)
    f = pos - i
    return tuple(round(stops[i][c] + (stops[i + 1][c] - stops[i][c]) * f) for c in range(3))


def cell_colours(bad: Sequence[Sequence[int]]) -> list[list[tuple[int, int, int]]]:
    """The colour of every cell: grey where clean, else by its share of the worst cell's count
    (square-root scaled so a single bad point next to thousands still shows)."""
    worst = max((v for row in bad for v in row), default=0)
    return [[_EMPTY if v == 0 else _ramp((v / worst) ** 0.5) for v in row] for row in bad]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bytes(bad: Sequence[Sequence[int]], cell: int | None = None, band: int = 24) -> bytes:
    """An RGB PNG of the grid: one `band`-pixel-high row of cells per rank (top: rank 0), a
    2-pixel gap between ranks; `cell` (pixels per column) defaults to what keeps the image near
    1000 pixels wide, from 2 to 24."""
    n_rows, n_cols = len(bad), len(bad[0])
    cell = cell or max(2, min(band, 1000 // n_cols))
    colours = cell_colours(bad)
    width = n_cols * cell
    lines = []
    for r, row in enumerate(colours):
        lines += [b"".join(bytes(c) * cell for c in row)] * band
        if r != n_rows - 1:
            lines += [bytes(_RANK_GAP) * width] * 2
    raw = b"".join(b"\x00" + ln for ln in lines)  # filter type 0 (none) on every scanline
    header = struct.pack(">IIBBBBB", width, len(lines), 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def write_png(path: str, bad: Sequence[Sequence[int]]) -> None:
    with open(path, "wb") as f:
        f.write(png_bytes(bad))
