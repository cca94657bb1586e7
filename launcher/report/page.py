"""What every HTML page of the report shares: the skeleton, the style, escaping, tables and
figures embedded as data URIs.

A page is one self-contained file: the style inline, every image a `data:` URI, no font,
script or stylesheet from anywhere else, so it reads the same offline, from a CI artifact or
an e-mail attachment; the only script is the sweep table's filter, inline. Figures come from
`launcher.report.svg` (those on every page) and `launcher.report.plots` (matplotlib: heat
maps, benchmarks); a figure that cannot be drawn (matplotlib absent, or it raised) leaves a
note in its place and the rest of the page stands.
"""

from __future__ import annotations

import base64
import contextlib
import html
import os
import sys
import time
from collections.abc import Callable, Iterable

from launcher.report import plots

CSS = """
:root { --pass: #1a7f37; --fail: #cf222e; --error: #bc4c00; --skip: #6e7781; --line: #d0d7de; --soft: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #1f2328; margin: 0; background: #fff; }
main { padding: 16px 24px 40px; }
main > p { max-width: 140ch; }
#summary { font-weight: 600; font-size: 15px; }
h1 { font-size: 20px; margin: 8px 0 4px; display: flex; align-items: center; gap: 12px; flex-wrap: wrap; }
h2 { font-size: 17px; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 18px 0 6px; }
a { color: #0969da; }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace; font-size: 12.5px; }
pre { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px;
      overflow-x: auto; white-space: pre; margin: 6px 0; }
.verdict { display: inline-block; font-weight: 700; letter-spacing: .04em; color: #fff; border-radius: 6px;
           padding: 2px 12px; font-size: 18px; }
.v-PASS { background: var(--pass); } .v-FAIL { background: var(--fail); }
.v-ERROR { background: var(--error); } .v-SKIP { background: var(--skip); } .v-UNCHECKED { background: #0969da; }
.tag { display: inline-block; font-weight: 600; border-radius: 4px; padding: 0 6px; font-size: 12px; color: #fff; }
.case { color: #57606a; margin: 2px 0 10px; }
.case span { margin-right: 14px; white-space: nowrap; }
table { border-collapse: collapse; margin: 6px 0 10px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; white-space: nowrap; }
td:first-child { white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.sub td { color: #57606a; font-size: 13px; }
tr.sub td:nth-child(2) { white-space: nowrap; }
tr.sub td:first-child { border-top-color: transparent; }
tr.hit td { background: #fff1f0; }
.label { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; color: #57606a;
         max-width: 640px; overflow-wrap: anywhere; }
figure { margin: 10px 0 16px; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; }
figcaption { color: #57606a; font-size: 13px; }
.note { border-left: 4px solid #d4a72c; background: #fff8c5; padding: 6px 10px; margin: 10px 0; }
.error-box { border-left: 4px solid var(--error); background: #fff1e5; padding: 6px 10px; margin: 10px 0; }
.counts span { margin-right: 10px; }
details > summary { cursor: pointer; color: #57606a; }
.filters { display: flex; gap: 14px; align-items: center; flex-wrap: wrap; margin: 8px 0; }
.filters label { color: #57606a; }
footer { color: #8c959f; font-size: 12px; margin-top: 32px; }
"""


class Raw(str):
    """HTML written as it is (a link, a badge); anything else put into a page is escaped."""


def esc(value) -> str:
    if isinstance(value, Raw):
        return value
    return html.escape("-" if value is None else str(value))


def badge(verdict: str, big: bool = True) -> Raw:
    cls = "verdict" if big else "tag"
    return Raw(f'<span class="{cls} v-{esc(verdict)}" data-verdict="{esc(verdict)}">{esc(verdict)}</span>')


def link(href: str, text) -> Raw:
    return Raw(f'<a href="{esc(href)}">{esc(text)}</a>')


def table(head: Iterable, rows: Iterable[Iterable], *, row_attrs: Iterable[str] | None = None,
          numeric: Iterable[int] = (), attrs: str = "") -> Raw:
    """A table; `row_attrs`: each row's attributes (class, data-*); cells of the `numeric`
    columns align right."""
    numeric = set(numeric)
    rows = [list(r) for r in rows]
    extra = list(row_attrs) if row_attrs is not None else [""] * len(rows)
    out = [f"<table{' ' + attrs if attrs else ''}><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for row, ra in zip(rows, extra):
        cells = "".join(f'<td{" class=num" if i in numeric else ""}>{esc(c)}</td>' for i, c in enumerate(row))
        out.append(f"<tr{' ' + ra if ra else ''}>{cells}</tr>")
    out.append("</tbody></table>")
    return Raw("".join(out))


def pre(text: str) -> Raw:
    return Raw(f"<pre>{esc(text)}</pre>")


def note(text: str) -> Raw:
    return Raw(f'<div class="note">{esc(text)}</div>')


def _img(mime: str, data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return f'<img alt="{esc(alt)}" src="data:{mime};base64,{encoded}">'


def _figure(image: Callable[[], tuple[str, bytes]], alt: str, caption: str) -> Raw:
    try:
        mime, data = image()
    except Exception as e:  # a figure is never worth a page: say what failed, keep the rest
        return note(f"figure not drawn ({alt}): {type(e).__name__}: {e}")
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return Raw(f"<figure>{_img(mime, data, alt)}{cap}</figure>")


def figure(draw: Callable[[], object] | bytes, alt: str, caption: str = "") -> Raw:
    """A matplotlib figure: `draw()` returns a Figure (or the PNG bytes are given), embedded as
    a data URI; without matplotlib, nothing (the page says once, at its top, how to get it)."""
    if not isinstance(draw, bytes) and not plots.available():
        return Raw("")
    return _figure(lambda: ("image/png", draw if isinstance(draw, bytes) else plots.png(draw())), alt, caption)


def svg_figure(draw: Callable[[], str], alt: str, caption: str = "") -> Raw:
    """An SVG figure (`launcher.report.svg`): `draw()` returns the SVG text, embedded as a data URI."""
    return _figure(lambda: ("image/svg+xml", draw().encode("utf-8")), alt, caption)


def plots_note() -> Raw:
    """Where matplotlib is absent: the heat maps and benchmark charts are tables only, and the
    page says how to get them."""
    if plots.available():
        return Raw("")
    return note(f"Heat maps and benchmark charts are not shown: matplotlib is not installed. Their tables are; "
                f"for the figures: {plots.INSTALL_HINT}, then run again.")


def relative(path: str, start: str) -> str:
    """`path` as a link from a page in folder `start` (forward slashes, for any browser)."""
    try:
        rel = os.path.relpath(path, start)
    except ValueError:  # another drive (Windows): an absolute file link
        return "file://" + os.path.abspath(path)
    return rel.replace(os.sep, "/")


def document(title: str, body: list[str], script: str = "") -> str:
    """The whole page: the inline style, `body`'s parts in order, an optional inline script."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    js = f"<script>{script}</script>" if script else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<link rel=\"icon\" href=\"data:,\">"  # no favicon request, also not from file://
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body><main>\n"
            + "\n".join(body)
            + f"\n<footer>dsv4-tp-harness report, written {esc(stamp)}</footer></main>{js}</body></html>\n")


def write(path: str, text: str) -> str | None:
    """The page, written whole or not at all; a failure is a warning, never the run's outcome.
    Returns the path, or None when it could not be written."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return path
    except OSError as e:
        with contextlib.suppress(OSError):  # a full disk: no half-written temp file stays behind
            os.unlink(tmp)
        print(f"warning: {path} not written: {e}", file=sys.stderr)
        return None
