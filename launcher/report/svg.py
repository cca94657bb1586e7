"""The figures every page draws, written here as SVG: each rank's phase times (a run's page)
and a sweep's jobs x tensors map (the sweep's page).

They are on every page, a passing run's included, so they must cost nothing: written as text
they take a millisecond and no import, where matplotlib (kept for the failure heat maps and the
benchmark figures, `launcher.report.plots`) takes half a second to import and a fifth of a
second per figure. They need no optional package either. Each shape carries a <title>, which a
browser shows on hover, with the exact figure it stands for. There are no font metrics here:
text widths are estimated generously, so that labels get room for wide glyphs.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from launcher.config.rank_phases import RANK_PHASES

FONT = "system-ui, -apple-system, Segoe UI, Roboto, Arial, sans-serif"
INK = "#1f2328"
GRID = "#dddddd"
EMPTY = "#e6e6e6"  # a tensor a job did not compare (or a job that compared nothing: an error)
BITWISE = "#d9f0d3"  # a tensor that was bitwise equal to the reference
PHASE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#9d755d")
DIFF_COLOURS = ("#fff7bc", "#fec44f", "#d95f0e", "#7f0000")  # small to large max |diff|


def tick_positions(n: int, most: int) -> list[int]:
    """Up to `most` evenly spread positions of n rows or columns, the first and the last included."""
    if n <= most:
        return list(range(n))
    step = math.ceil((n - 1) / (most - 1))
    return sorted(set(range(0, n, step)) | {n - 1})


def linear_ticks(hi: float, most: int = 6) -> list[float]:
    """0, s, 2s, ... up to the first tick at or above `hi`, with a 1-2-5 step s."""
    hi = hi if hi > 0 and math.isfinite(hi) else 1.0
    raw = hi / most
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    return [round(i * step, 12) for i in range(math.ceil(hi / step - 1e-9) + 1)]


def text_width(text: str, size: float) -> float:
    return 0.62 * size * len(text)


def _attrs(attrs: dict) -> str:
    return "".join(f' {k.replace("_", "-")}="{html.escape(str(v))}"' for k, v in attrs.items())


def rect(x: float, y: float, w: float, h: float, fill: str, tip: str | None = None, **attrs) -> str:
    body = f"<title>{html.escape(tip)}</title>" if tip else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" fill="{fill}"'
            f'{_attrs(attrs)}>{body}</rect>')


def text(x: float, y: float, value: str, size: float = 11, anchor: str = "start", **attrs) -> str:
    return (f'<text x="{x:.2f}" y="{y:.2f}" font-size="{size}" text-anchor="{anchor}"{_attrs(attrs)}>'
            f"{html.escape(value)}</text>")


def line(x1: float, y1: float, x2: float, y2: float, stroke: str, **attrs) -> str:
    return f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" stroke="{stroke}"{_attrs(attrs)}/>'


def document(width: float, height: float, parts: list[str], defs: str = "") -> str:
    """A standalone SVG (its width and height are the image's natural size in a page)."""
    w, h = math.ceil(width), math.ceil(height)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="{FONT}" fill="{INK}">'
            + (f"<defs>{defs}</defs>" if defs else "")
            + rect(0, 0, w, h, "#ffffff") + "".join(parts) + "</svg>")


def _seconds(value: float) -> str:
    return f"{value:.3g} s"


def phase_times(rank_seconds: Sequence[dict | None]) -> str:
    """Each rank's phase times as one horizontal bar of stacked phases (rank 0 on top), the
    phases in the order a rank runs them, a legend beside the axis."""
    phases = [s for s in RANK_PHASES if any(s in (r or {}) for r in rank_seconds)]
    ranks = len(rank_seconds)
    totals = [sum((r or {}).get(s, 0.0) for s in phases) for r in rank_seconds]
    ticks = linear_ticks(max(totals, default=0.0))
    band = max(6.0, min(24.0, 900.0 / max(ranks, 1)))
    legend = 28 + max((text_width(s, 12) for s in phases), default=0.0)
    left, top, bottom, width = 56.0, 34.0, 48.0, 900.0
    plot_w = width - left - legend - 24
    plot_h = band * ranks
    scale = plot_w / ticks[-1]
    parts = [text(left + plot_w / 2, 20, "phase times per rank", 13, "middle")]
    for t in ticks:
        x = left + t * scale
        parts += [line(x, top, x, top + plot_h, GRID), text(x, top + plot_h + 16, f"{t:g}", 11, "middle")]
    for rank, seconds in enumerate(rank_seconds):
        x, y = left, top + rank * band + 0.15 * band
        for i, phase in enumerate(phases):
            value = (seconds or {}).get(phase, 0.0)
            w = value * scale
            if phase in (seconds or {}):
                parts.append(rect(x, y, w, 0.7 * band, PHASE_COLOURS[i % len(PHASE_COLOURS)],
                                  f"rank {rank}: {phase} {_seconds(value)}", data_rank=rank, data_phase=phase))
            x += w
    for rank in tick_positions(ranks, 32):
        parts.append(text(left - 6, top + (rank + 0.5) * band + 4, str(rank), 11, "end"))
    parts += [line(left, top, left, top + plot_h, INK), line(left, top + plot_h, left + plot_w, top + plot_h, INK),
              text(left + plot_w / 2, top + plot_h + 38, "seconds (phases of one rank, end to end)", 12, "middle"),
              text(14, top + plot_h / 2, "rank", 12, "middle", transform=f"rotate(-90 14 {top + plot_h / 2:.2f})")]
    lx = left + plot_w + 14
    for i, phase in enumerate(phases):
        y = top + i * 18
        parts += [rect(lx, y, 12, 12, PHASE_COLOURS[i % len(PHASE_COLOURS)]), text(lx + 18, y + 10.5, phase, 12)]
    height = top + max(plot_h, 18 * len(phases)) + bottom
    return document(width, height, parts)


def _mix(a: str, b: str, t: float) -> str:
    ca, cb = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (a, b))
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))


def _ink_on(fill: str) -> str:
    """Black on a light cell, white on a dark one."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return INK if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def diff_colour(value: float, lo: float, hi: float) -> str:
    """A positive max |diff| on the log scale lo..hi (clipped; inf and NaN at the top)."""
    if not math.isfinite(value):
        return DIFF_COLOURS[-1]
    t = (math.log10(value) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    t = min(max(t, 0.0), 1.0) * (len(DIFF_COLOURS) - 1)
    i = min(int(t), len(DIFF_COLOURS) - 2)
    return _mix(DIFF_COLOURS[i], DIFF_COLOURS[i + 1], t - i)


def diff_range(diffs: Sequence[Sequence[float | None]]) -> tuple[float, float]:
    """The colour scale's ends: the smallest and largest positive finite max |diff|, widened to
    at least a decade around their middle (so a lone value is coloured mid-scale)."""
    positive = [d for row in diffs for d in row if d is not None and math.isfinite(d) and d > 0]
    lo, hi = (min(positive), max(positive)) if positive else (1e-6, 1.0)
    if hi < lo * 10:
        mid = math.sqrt(lo * hi)
        lo, hi = mid / math.sqrt(10), mid * math.sqrt(10)
    return lo, hi


# The fixed colour scale of a map of max |diff| / tolerance: the tolerance itself (1) mid-scale, so
# that one figure reads alike on every page, whatever else the sweep holds.
BAND_SCALE = (1e-3, 1e3)


def sweep_map(job_labels: Sequence[str], tensors: Sequence[str], diffs: Sequence[Sequence[float | None]],
              failed: Sequence[Sequence[bool]], scale: tuple[float, float] | None = None,
              what: str = "max |diff|") -> str:
    """Jobs (rows) x tensors (columns): each compared tensor's max |diff| on a log colour
    scale; pale green where it was bitwise equal, grey where the job compared no such tensor
    (or compared nothing: an error); a cross on each failing tensor; a colour bar beside.
    `scale`: the colour scale's ends (default: the figures' own range, `diff_range`); `what`:
    what the figures are (`max |diff| / tolerance` with BAND_SCALE)."""
    n_jobs, n_tensors = len(job_labels), len(tensors)
    lo, hi = scale or diff_range(diffs)
    row = max(8.0, min(22.0, 3600.0 / max(n_jobs, 1)))
    shown = tick_positions(n_jobs, 80)
    label_size = 11 if row >= 12 else 8
    left = 34 + max((text_width(job_labels[j], label_size) for j in shown), default=0.0)
    slanted = n_tensors > 4  # the names slanted below their columns: narrow columns will do
    widest = max((text_width(t, 12) for t in tensors), default=0.0)
    col = 72.0 if slanted else max(64.0, min(160.0, 16 + widest))
    top = 50.0
    grid_w, grid_h = col * n_tensors, row * n_jobs
    names_h = widest * 0.5 + 20 if slanted else 22
    bar_x, bar_h = left + grid_w + 22, min(max(grid_h, 80.0), 260.0)
    legend = "\u2716 failed (reference or integrity); green: bitwise equal; grey: not compared"
    width = max(bar_x + 78, text_width(legend, 12) + 40)
    parts = [text(width / 2, 18, f"{what} per job and tensor", 13, "middle"), text(width / 2, 36, legend, 12, "middle")]
    for j, label in enumerate(job_labels):
        y = top + j * row
        for t, tensor in enumerate(tensors):
            d = diffs[j][t]
            if d is None:
                fill, tip = EMPTY, "not compared"
            elif d == 0:
                fill, tip = BITWISE, "bitwise equal"
            else:
                fill, tip = diff_colour(d, lo, hi), f"{what} {d:.3g}"
            bad = failed[j][t]
            parts.append(rect(left + t * col, y, col, row, fill, f"{label}, {tensor}: {tip}{', FAILED' if bad else ''}",
                              stroke="#ffffff", data_job=j, data_tensor=tensor, data_failed=str(bad).lower()))
            if bad:
                parts.append(text(left + (t + 0.5) * col, y + row / 2 + 0.35 * min(12, row), "\u2716",
                                  min(12, row), "middle", fill=_ink_on(fill), data_job=j, data_tensor=tensor))
    for j in shown:
        parts.append(text(left - 6, top + (j + 0.5) * row + 0.35 * label_size, job_labels[j], label_size, "end"))
    for t, tensor in enumerate(tensors):
        x, y = left + (t + 0.5) * col, top + grid_h + 15
        if slanted:
            parts.append(text(x, y, tensor, 12, "end", transform=f"rotate(-30 {x:.2f} {y:.2f})"))
        else:
            parts.append(text(x, y, tensor, 12, "middle"))
    parts += [text(left + grid_w / 2, top + grid_h + names_h + 16, "tensor", 12, "middle"),
              text(12, top + grid_h / 2, "job", 12, "middle", transform=f"rotate(-90 12 {top + grid_h / 2:.2f})")]
    stops = "".join(f'<stop offset="{i / (len(DIFF_COLOURS) - 1):.3f}" stop-color="{c}"/>'
                    for i, c in enumerate(DIFF_COLOURS))
    parts.append(rect(bar_x, top, 14, bar_h, "url(#diff-scale)", stroke=INK, stroke_width="0.5"))
    decades = list(range(math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9) + 1))
    for k in decades[::max(1, math.ceil(len(decades) / 8))]:
        y = top + bar_h * (1 - (k - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))
        parts += [line(bar_x + 14, y, bar_x + 18, y, INK), text(bar_x + 21, y + 4, f"1e{k}", 11)]
    parts.append(text(bar_x + 64, top + bar_h / 2, "max |diff|" if scale is None else "x tolerance", 12, "middle",
                      transform=f"rotate(-90 {bar_x + 64:.2f} {top + bar_h / 2:.2f})"))
    defs = f'<linearGradient id="diff-scale" x1="0" y1="1" x2="0" y2="0">{stops}</linearGradient>'
    return document(width, top + max(grid_h + names_h + 28, bar_h + 12), parts, defs)
