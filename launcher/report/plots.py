"""The report's figures drawn with matplotlib: a failing tensor's error grids as heat maps, a
benchmark's rounds and stages; and the PNG files of `report.plots=true`. (The figures every
page has, stage times and a sweep's map, are SVG written by `launcher.report.svg`.)

Every figure is built from the result dicts alone (result.json, summary.json rows), as a
`matplotlib.figure.Figure` on the Agg canvas: no pyplot, so no GUI backend, no global figure
state, nothing left open. `png(fig)` turns one into PNG bytes (the HTML pages embed them, the
PNG files are the same bytes).

matplotlib is optional (the `plots` extra): it is imported on first use, not at import time,
so a passing run never pays for it, and `available()` says whether it is there. Without it
the pages show these figures' tables only (`launcher.report.page`), and `report.plots=true`
writes no PNG and says why.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import os
import re
import sys
import threading
from collections.abc import Sequence

from launcher.report.svg import EMPTY, tick_positions

INSTALL_HINT = "pip install 'dsv4-tp-harness[plots]' (or pip install matplotlib)"
DPI = 100
WORST = "#0a84ff"  # the outline and star of a heat map's worst cell (no red or yellow: it must stand out)


@functools.cache
def available() -> bool:
    """Whether matplotlib can be imported here (the plots extra is installed)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out install counts as absent
        return False


def preload_in_background() -> None:
    """Import matplotlib on a thread while a benchmark's ranks run (its page draws the rounds'
    figures): the launcher only waits for them then, and the import takes 0.5 s and more."""
    if available():
        threading.Thread(target=_preload, name="matplotlib-preload", daemon=True).start()


def _preload() -> None:
    try:
        _mpl()
        importlib.import_module("matplotlib.backends.backend_agg")
    except Exception:  # the page's own import will say what is wrong, where it is used
        pass


def _mpl():
    """matplotlib's Figure class and colour module, imported on first use."""
    from matplotlib import colors
    from matplotlib.figure import Figure

    return Figure, colors


def figure(width: float, height: float):
    """A new Figure on the Agg canvas (never pyplot's GUI backends); constrained layout."""
    Figure, _ = _mpl()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png(fig) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


# -- where a failing tensor's errors are -------------------------------------------------------


def worst_cell(grid: dict) -> tuple[int, int]:
    """(rank, column) of the grid's worst cell: most bad points, then the largest max |diff|
    (the cell the console's `worst:` line names)."""
    bad, diff = grid["bad"], grid["max_abs_diff"]
    return max(((r, c) for r in range(len(bad)) for c in range(len(bad[r]))),
               key=lambda rc: (bad[rc[0]][rc[1]], diff[rc[0]][rc[1]]))


def heatmap(tensor: str, grid: dict):
    """One grid of `launcher.verify.where` as a heat map: rows are ranks (rank 0 on top),
    columns the grid's columns; grey cells have no bad point, the others go from yellow to dark
    red with their count (square-root scale, so one bad point next to thousands still shows);
    the worst cell is outlined, starred and named in the title."""
    import numpy as np

    _, colors = _mpl()
    bad = np.asarray(grid["bad"], dtype=float)
    ranks, cols = bad.shape
    r, c = worst_cell(grid)
    fig = figure(min(12.0, max(6.0, 2.5 + 0.42 * cols)), min(9.0, 1.9 + 0.32 * ranks))
    ax = fig.add_subplot()
    cmap = colors.LinearSegmentedColormap.from_list("bad", ["#ffeda0", "#feb24c", "#f03b20", "#800026"]).with_extremes(bad=EMPTY)
    im = ax.imshow(np.ma.masked_equal(bad, 0), cmap=cmap, aspect="auto", interpolation="nearest",
                   norm=colors.PowerNorm(0.5, vmin=0, vmax=max(bad.max(), 1)))
    ax.add_patch(_rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=WORST, linewidth=3, label="worst cell"))
    ax.plot([c], [r], marker="*", markersize=15, color=WORST, markeredgecolor="white", linestyle="none")
    ys = tick_positions(ranks, 32)
    ax.set_yticks(ys, [str(i) for i in ys])
    xs = tick_positions(cols, 24)
    labels = grid["col_labels"]
    wide = max(len(labels[i]) for i in xs) > 3  # "8-15": slanted, so that neighbours never overlap
    ax.set_xticks(xs, [labels[i] for i in xs], rotation=45 if wide else 0, ha="right" if wide else "center")
    if cols <= 48 and ranks <= 32:  # cell borders where cells are wide enough to see them
        ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, ranks)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
    each = f" ({grid['cell']} each)" if grid.get("cell") else ""
    ax.set_xlabel(f"{grid['cols']}{each}")
    ax.set_ylabel("rank")
    total = int(bad.sum())
    ax.set_title(f"{tensor}: {total} bad points per rank and {grid['cols']}\n"
                 f"worst (\u2605): rank {r}, {grid['cols']} {labels[c]}: "
                 f"{grid['bad'][r][c]}/{grid['numel'][r][c]} bad, max|diff| {grid['max_abs_diff'][r][c]:.3g}",
                 fontsize=10)
    fig.colorbar(im, ax=ax, label="bad points in the cell", pad=0.01)
    return fig


def _rectangle(*args, **kwargs):
    from matplotlib.patches import Rectangle

    return Rectangle(*args, **kwargs)


def error_grids(result: dict):
    """(tag, verdict, grid) of every grid with bad points of every failing verdict; tag is ""
    for the primary reference, "recomputed_" for the golden recomputed from a snapshot."""
    tagged = [("", v) for v in result.get("verdicts", [])]
    tagged += [("recomputed_", v) for v in result.get("recomputed_verdicts", [])]
    for tag, v in tagged:
        if v["passed"]:
            continue
        for g in v.get("where") or []:
            if any(map(any, g["bad"])):
                yield tag, v, g


def heatmap_file(tag: str, tensor: str, grid: dict) -> str:
    """The file name of a grid's PNG (`report.plots=true`)."""
    return f"heatmap_{tag}{_slug(tensor)}_{_slug(grid['name'])}.png"


def write_plots(result: dict, output_dir: str) -> list[str]:
    """`report.plots=true`: a PNG heat map of every grid with bad points of every failing
    verdict, next to result.json; the paths written. Without matplotlib nothing is written
    and a warning says how to install it."""
    grids = list(error_grids(result))
    if grids and not available():
        print(f"warning: report.plots=true wrote no PNG: matplotlib is not installed ({INSTALL_HINT})",
              file=sys.stderr)
        return []
    paths = []
    for tag, v, g in grids:
        path = os.path.join(output_dir, heatmap_file(tag, v["tensor"], g))
        with open(path, "wb") as f:
            f.write(png(heatmap(v["tensor"], g)))
        paths.append(path)
    return paths


# -- a benchmark ----------------------------------------------------------------------------


def round_times(bench: dict) -> list[float]:
    """A benchmark's time per round: its slowest rank's (`raw_s`: rounds x ranks)."""
    return [max(r) if isinstance(r, list) else float(r) for r in bench.get("raw_s") or [] if r not in (None, [])]


def bench_histogram(bench: dict):
    """A histogram of a benchmark's rounds (each round's slowest rank), the min and the median
    marked."""
    times = sorted(round_times(bench))
    fig = figure(7.0, 3.2)
    ax = fig.add_subplot()
    scale, unit = (1e3, "ms") if times[-1] < 1.0 else (1.0, "s")
    ax.hist([t * scale for t in times], bins=min(30, max(5, len(times) // 2)), color="#4c78a8", edgecolor="white")
    for key, style, name in (("min_s", ":", "min"), ("median_s", "--", "median")):
        value = bench.get(key)
        if isinstance(value, (int, float)):
            ax.axvline(value * scale, color="#e45756", linestyle=style, label=f"{name} {value * scale:.3g} {unit}")
    ax.set_xlabel(f"{unit} per round (the slowest rank)")
    ax.set_ylabel("rounds")
    ax.set_title(f"{len(times)} timed rounds", fontsize=10)
    ax.legend(frameon=False, fontsize=9)
    return fig


def bench_stages(stages: Sequence[dict]):
    """Where a benchmark round's time goes: each stage's median (of its slowest rank per round)
    as a bar, in the layer's stage order, the collectives in their own colour."""
    names = [s["stage"] for s in stages]
    values = [s["median_s"] for s in stages]
    scale, unit = (1e3, "ms") if max(values, default=0.0) < 1.0 else (1.0, "s")
    fig = figure(8.0, min(10.0, 1.4 + 0.3 * len(stages)))
    ax = fig.add_subplot()
    colours = ["#f58518" if s.get("collective") else "#4c78a8" for s in stages]
    ax.barh(range(len(stages)), [v * scale for v in values], color=colours, height=0.7)
    ax.set_yticks(range(len(stages)), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per round (median of the slowest rank)")
    ax.set_title("time per stage (orange: collectives, blue: compute)", fontsize=10)
    ax.grid(axis="x", color="#dddddd")
    ax.set_axisbelow(True)
    return fig
