"""PNG heat maps of where a failing tensor's errors are (`report.plots=true`), next to result.json.

Draws the grids `launcher.verify.where` put into a failing verdict's `where`: one image per
grid with bad points, rows are ranks (top: rank 0), columns the grid's columns. The PNG is
written with zlib and struct alone (no plotting dependency).
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Sequence


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def write_plots(result: dict, output_dir: str) -> list[str]:
    """A PNG heat map of every grid with bad points of every failing verdict; the paths written.

    Rows are ranks (top: rank 0), columns the grid's columns; grey cells have no bad point,
    the others go from light yellow to dark red with the square root of their share of the
    worst cell's count.
    """
    paths = []
    tagged = [("", v) for v in result.get("verdicts", [])]
    tagged += [("recomputed_", v) for v in result.get("recomputed_verdicts", [])]
    for tag, v in tagged:
        if v["passed"]:
            continue
        for g in v.get("where") or []:
            if not any(map(any, g["bad"])):
                continue
            path = os.path.join(output_dir, f"heatmap_{tag}{_slug(v['tensor'])}_{_slug(g['name'])}.png")
            write_png(path, g["bad"])
            paths.append(path)
    return paths


# -- the PNG encoder -------------------------------------------------------------------------------

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
