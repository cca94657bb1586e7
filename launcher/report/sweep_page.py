"""The sweep page: `report.html` in a sweep's folder, beside summary.json and junit.xml.

Built from the sweep's summary (`launcher.report.sweep_summary.write_summary`) and its jobs'
result.json files: the pass / fail / error / skip counts; every job in one table, filterable by
layer, scope, model, the case's keys (tp or ep, dp; the MoE layer's layer_id, num_tokens and
balanced_routing) and verdict (a small inline script; without it every row shows), each
job linking to its own page by a relative path, so the folder can move as a whole; and a
jobs x tensors map of each compared tensor's max |diff|. A job with several TP or EP groups (dp > 1)
shows its first failing group's tensors, as its result.json's top level does.
"""

from __future__ import annotations

import json
import os
import sys

from layers.contract.case import GROUP_KEYS, INT_KEYS, LIST_KEYS

from launcher.report import svg
from launcher.config.verdict_words import fails_the_run
from launcher.report.console import case_columns, fmt, starts_text, varied_columns, varying_keys
from launcher.report.verdict import integrity_failures
from launcher.report.page import Raw, badge, document, esc, link, relative, svg_figure, table, write
from launcher.report.run_page import PAGE


# Hides the rows that do not match every chosen filter value; counts the rows shown.
FILTER_SCRIPT = """
(function () {
  var selects = Array.prototype.slice.call(document.querySelectorAll('select[data-filter]'));
  var rows = Array.prototype.slice.call(document.querySelectorAll('#jobs tbody tr'));
  function apply() {
    var shown = 0;
    rows.forEach(function (row) {
      var keep = selects.every(function (s) { return !s.value || row.getAttribute('data-' + s.dataset.filter) === s.value; });
      row.hidden = !keep;
      if (keep) { shown += 1; }
    });
    document.getElementById('shown').textContent = shown + ' of ' + rows.length + ' jobs shown';
  }
  selects.forEach(function (s) { s.addEventListener('change', apply); });
  apply();
})();
"""


def write_sweep_page(sweep_dir: str, summary: dict) -> str | None:
    """report.html of the sweep in `sweep_dir`; its path (None: not written, with a warning)."""
    try:
        text = render(summary, sweep_dir)
    except Exception as e:  # never worth the sweep's summary or exit status
        print(f"warning: {os.path.join(sweep_dir, PAGE)} not written: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return write(os.path.join(sweep_dir, PAGE), text)


def _overall(rows: list[dict]) -> str:
    """The sweep's word: its worst job's (a skip alone decides nothing)."""
    words = {r["verdict"] for r in rows}
    for word in ("ERROR", "FAIL", "PASS", "UNCHECKED"):
        if word in words:
            return word
    return "SKIP" if words else "PASS"


def _value(row: dict, key: str) -> str:
    return "" if row.get(key) is None else str(row[key])


def render(summary: dict, sweep_dir: str) -> str:
    rows = summary["jobs"]
    word = _overall(rows)
    name = os.path.basename(os.path.normpath(sweep_dir))
    kinds = [("passed", "PASS"), ("failed", "FAIL"), ("errors", "ERROR"), ("skipped", "SKIP")]
    if summary.get("unchecked"):  # golden=false jobs: performance runs
        kinds.append(("unchecked", "UNCHECKED"))
    counts = "".join(f"<span>{badge(v, big=False)} {summary.get(k, 0)} {k}</span>" for k, v in kinds)
    body = [f"<h1>{badge(word)}<span>sweep {esc(name)}</span></h1>",
            f'<div class="case">{esc(os.path.abspath(sweep_dir))} · {summary["n_jobs"]} jobs · '
            f'varies: <code id="varies">{esc(", ".join(varying_keys(rows)) or "nothing")}</code></div>',
            f'<p class="counts" id="counts">{counts}</p>']
    if summary.get("interrupted"):
        body.append('<div class="note">The sweep was interrupted: the jobs it never ran are skips.</div>')
    body += ["<h2>jobs</h2>", _filters(rows), _jobs_table(rows, sweep_dir)]
    body += _map(rows)
    links = [link(f, f) for f in ("summary.json", "junit.xml") if os.path.isfile(os.path.join(sweep_dir, f))]
    if links:
        body.append(f"<p>Also in this folder: {Raw(' · '.join(links))}</p>")
    return document(f"{word} sweep {name}", body, FILTER_SCRIPT)


NUMERIC = ("dp", *INT_KEYS)


def _filter_keys(rows: list[dict]) -> list[str]:
    """What the table filters by: layer, scope, model, the case keys the table shows (but
    tokens and start positions: a sweep's many values), verdict."""
    case = [k for k in case_columns(rows) + varied_columns(rows) if k not in ("local_t", *LIST_KEYS)]
    return ["layer", "scope", "model", *case, "verdict"]


def _filters(rows: list[dict]) -> Raw:
    parts = ['<div class="filters">']
    for key in _filter_keys(rows):
        numeric = key in NUMERIC
        values = sorted({_value(r, key) for r in rows} - {""}, key=lambda v: (len(v), v) if numeric else (0, v))
        options = "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)
        parts.append(f'<label>{esc(key)} <select id="filter-{key}" data-filter="{key}">'
                     f'<option value="">all</option>{options}</select></label>')
    parts.append(f'<span id="shown">{len(rows)} jobs</span></div>')
    return Raw("".join(parts))


def _jobs_table(rows: list[dict], sweep_dir: str) -> Raw:
    keys = _filter_keys(rows)
    benched = any(r.get("bench_median_s") is not None for r in rows)

    def job_link(r):
        page = os.path.join(r["output_dir"], PAGE) if r.get("output_dir") not in (None, "", "-") else None
        return link(relative(page, sweep_dir), f"job {r['job']}") if page and os.path.isfile(page) else f"job {r['job']}"

    def median_ms(r):
        return fmt(r["bench_median_s"] * 1e3) if r.get("bench_median_s") is not None else "-"

    def case_value(r, k):
        return starts_text(r.get(k)) if k == "start_pos" else fmt(r.get(k))

    # (header, cell, right-aligned): the case keys of the layers swept, the median round of a benchmark
    columns = [("job", job_link, False),
               *((k, lambda r, k=k: case_value(r, k), k in NUMERIC)
                 for k in ("layer", "scope", "model", *case_columns(rows), *varied_columns(rows))),
               ("verdict", lambda r: badge(r["verdict"], big=False), False),
               ("tensor", lambda r: fmt(r.get("tensor")), False),
               ("max|diff|", lambda r: fmt(r.get("max_abs_diff")), True),
               ("bad", lambda r: f"{r['n_bad']}/{r['numel']}" if r.get("n_bad") is not None else "-", True),
               ("wall s", lambda r: fmt(r.get("wall_s")), True),
               *([("bench median ms", median_ms, True)] if benched else []),
               ("message", lambda r: r.get("message") or "", False)]
    cells = [[cell(r) for _, cell, _ in columns] for r in rows]
    attrs = [" ".join(f'data-{k}="{esc(_value(r, k))}"' for k in keys) + f' data-job="{r["job"]}"' for r in rows]
    return table([h for h, _, _ in columns], cells, row_attrs=attrs,
                 numeric=[i for i, (_, _, right) in enumerate(columns) if right], attrs='id="jobs"')


def _job_results(rows: list[dict]) -> list[dict | None]:
    results = []
    for r in rows:
        try:
            with open(os.path.join(r["output_dir"], "result.json")) as f:
                results.append(json.load(f))
        except (OSError, ValueError, TypeError):
            results.append(None)
    return results


def in_bands(v: dict) -> float | None:
    """A verdict's max |diff| over its check's own tolerance: a pool's or allclose check's
    tolerance at that point (`tol_at_max`), x_out's diff_thd (its band is diff_thd x max(1, |e|):
    this is the larger ratio); a check with no tolerance (bitwise) is 0 or inf. None: no figure."""
    f = v.get("figures") or {}
    d = f.get("max_abs_diff")
    if d is None:
        return None
    band = f.get("tol_at_max") or f.get("diff_thd") or f.get("atol")
    if not band:
        return 0.0 if d == 0 else float("inf")
    return d / band


def _map(rows: list[dict]) -> list[str]:
    """Jobs x tensors: each compared tensor's max |diff| (a figure, and the same as a table)."""
    results = _job_results(rows)
    tensors: list[str] = []
    for res in results:
        for v in (res or {}).get("verdicts", []):
            if v["tensor"] not in tensors:
                tensors.append(v["tensor"])
    if not tensors:
        return []
    diffs, bands, failed = [], [], []
    for res in results:
        by_name = {v["tensor"]: v for v in (res or {}).get("verdicts", [])}
        diffs.append([by_name[t].get("figures", {}).get("max_abs_diff") if t in by_name else None for t in tensors])
        bands.append([in_bands(by_name[t]) if t in by_name else None for t in tensors])
        # A cross where the tensor decided a FAIL: its reference check or one of its integrity checks.
        broken = {c["tensor"] for c in integrity_failures(res)} if res and res.get("status") == "ok" else set()
        failed.append([t in broken or (t in by_name and fails_the_run(by_name[t])) for t in tensors])
    # A job is named by its group size and by each other case key the sweep varies.
    keys = [k for k in case_columns(rows) if k in GROUP_KEYS or len({_value(r, k) for r in rows}) > 1]
    keys += varied_columns(rows)
    labels = [" ".join(x for x in (f"{r['job']}", _value(r, "layer"),
                                   "" if r.get("scope") in (None, "full") else r["scope"], _value(r, "model"),
                                   *(f"{k}={starts_text(r[k]) if k == 'start_pos' else r[k]}" for k in keys
                                     if r.get(k) is not None),
                                   r["verdict"]) if x)
              for r in rows]
    text_rows = [[label, *("-" if d is None else (f"{fmt(d)} FAIL" if f else fmt(d)) for d, f in zip(ds, fs))]
                 for label, ds, fs in zip(labels, diffs, failed)]
    return ["<h2>worst errors: jobs x tensors</h2>",
            svg_figure(lambda: svg.sweep_map(labels, tensors, bands, failed, svg.BAND_SCALE, "max |diff| / tolerance"),
                       "jobs x tensors map of max |diff| in tolerances",
                       "each compared tensor's max |diff| over its own check's tolerance, per job: 1 is the "
                       "tolerance, on the same scale on every page"),
            "<details><summary>the same, as a table</summary>"
            + table(["job", *tensors], text_rows, numeric=range(1, len(tensors) + 1), attrs='id="map"')
            + "</details>"]
