"""The run page: `report.html` beside every run's result.json, whatever the run's outcome.

Built from the result dict alone (`launcher.report.result`) plus what lies in the run's
folder (its rank logs, the PNGs of `report.plots=true`, the profiler traces): the case and the
verdict; every compared tensor with its comparator, verdict, figures and per-rank rows (a table
per TP or EP group where dp > 1); for a failing tensor the comparator's account and its error grids
(`verdict["where"]`) as heat maps; the per-rank phase times as a chart; the bisect table; the
benchmark's figures, a histogram of its rounds and each stage's share (`result["bench"]`);
links to each rank's logs. An error, a refused config, a skipped job and a performance-only
run (UNCHECKED) get a page too, saying what happened and where the logs are.

`write_result_and_page` is what the entry points call: result.json, then this page.
"""

from __future__ import annotations

import glob
import os
import re
import sys

from launcher.config.rank_phases import RANK_PHASES
from launcher.report import plots, svg
from launcher.report.console import (
    beyond_reference_line,
    case_items, comparator_text, fmt, group_text, reference_line, starts_text, where_lines,
)
from launcher.report.page import (
    Raw,
    badge,
    document,
    esc,
    figure,
    link,
    note,
    plots_note,
    pre,
    relative,
    svg_figure,
    table,
    write,
)
from launcher.report.result import failed_phase, verdict, verdict_pair, write_result
from launcher.report.verdict import check_names, compared, decision, line as verdict_line

PAGE = "report.html"


def write_result_and_page(output_dir: str, result: dict, job: dict | None = None) -> dict:
    """result.json (`launcher.report.result.write_result`) and report.html beside it: what every
    run leaves, whatever its outcome. Returns the result as written."""
    written = write_result(output_dir, result, job)
    write_page(output_dir, written)
    return written


def write_page(output_dir: str, result: dict) -> str | None:
    """report.html of the run whose result.json is in `output_dir`; its path (None: not written,
    with a warning: a page is never worth a run's outcome)."""
    try:
        text = render(result, output_dir)
    except Exception as e:  # a result shape the page does not know: the run itself stands
        print(f"warning: {os.path.join(output_dir, PAGE)} not written: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return write(os.path.join(output_dir, PAGE), text)


def render(result: dict, output_dir: str | None = None) -> str:
    """The page's HTML. `output_dir`: the run's folder, where its logs and PNGs are found (None:
    the page names no file)."""
    word = verdict(result)
    c = result["case"]
    title = f"{word} {c.get('layer')} {group_text(c)}{' dp=' + str(c['dp']) if c.get('dp', 1) != 1 else ''} {c.get('model')}"
    body = [_header(result, word, output_dir)]
    if any(plots.error_grids(result)) or result.get("bench"):  # figures that need matplotlib
        body.append(plots_note())
    if result["status"] != "ok":
        body.append(_error(result))
    elif result.get("unchecked"):
        body.append(note("golden=false: a performance-only run. No golden was computed and nothing was compared; "
                         "the benchmark below is all it measured."))
    elif "compared_on_node" in result:
        body.append(note(f"node {result.get('node_rank')}: rank 0 on node {result['compared_on_node']} compared; "
                         f"its verdict: {word}. The tensors, figures and grids are in node "
                         f"{result['compared_on_node']}'s report."))
    else:
        body.append(f"<p>{esc(reference_line(result))}</p>")
        for group in result.get("groups") or [None]:
            body += _group(result, group, output_dir)
    if result.get("rank_seconds"):
        body += _phase_times(result)
    if result.get("bisect"):
        body += _bisect(result["bisect"])
    if result.get("bench"):
        body += _bench(result["bench"], output_dir)
    body += _logs(result, output_dir)
    if output_dir is not None and os.path.isfile(os.path.join(output_dir, "result.json")):
        body.append(f"<p>All figures: {link('result.json', 'result.json')}</p>")
    return document(title, body)


# -- the case and the verdict ------------------------------------------------------------------


def _header(result: dict, word: str, output_dir: str | None) -> Raw:
    c = result["case"]
    scope = c.get("scope") or "full"
    dp = f" · dp={c['dp']}" if c.get("dp", 1) != 1 else ""
    head = (f"<h1>{badge(word)}<span>{esc(c.get('layer'))} {esc(scope)} · {esc(c.get('model'))} · "
            f"{esc(group_text(c))}{esc(dp)}</span></h1>")
    case = "".join(f"<span>{esc(k)}=<code>{esc(starts_text(v) if k == 'start_pos' else v)}</code></span>"
                   for k, v in case_items(c))
    extra = [f"wall {fmt(result.get('wall_s'))} s"]
    extra += [f"{k} {result[k]}" for k in ("host", "torch") if result.get(k)]
    parts = [head, f'<div class="case">{case}</div>', f'<div class="case">{esc(" · ".join(extra))}</div>']
    if c.get("beyond_reference"):
        parts.append(f'<div class="case">{esc(beyond_reference_line(c))}</div>')
    job = result.get("job")
    if job:
        overrides = " ".join(o for o in job.get("overrides", []) if not o.startswith("hydra."))
        sweep = ""
        if output_dir is not None and os.path.isfile(os.path.join(output_dir, os.pardir, "sweep.json")):
            sweep = f" · {link('../report.html', 'the sweep')}"  # the job folder sits in the sweep folder
        parts.append(f'<div class="case">sweep job {esc(job.get("num"))}: <code>{esc(overrides)}</code>{sweep}</div>')
    if compared(result):
        # The console's VERDICT line: which check decided, the other verdict beside it, what was loosened.
        d = result.get("decision") or decision(result, word)
        parts.append(f'<p id="summary">{esc(verdict_line(d))}</p>')
        if "integrity" in result:
            parts.append(f'<p id="verdict-pair">{esc(verdict_pair(result))}</p>')
    return Raw("\n".join(parts))


def _error(result: dict) -> Raw:
    e = result.get("error") or {}
    status = result["status"]
    if status == "skipped":
        return Raw(f'<div class="error-box" id="error"><b>SKIPPED</b>: {esc(e.get("message"))}</div>')
    if status == "config-error":
        return Raw(f'<div class="error-box" id="error"><b>refused before any rank started</b>: '
                   f'{esc(e.get("message"))}</div>')
    phase = f" in phase '{failed_phase(e)}'" if failed_phase(e) else ""
    if e.get("rank") is None:
        head = f"the launcher failed{phase}"
    else:
        head = f"rank {e['rank']} failed{phase} (exit code {e.get('exitcode')})"
    parts = [f'<div class="error-box" id="error"><b>ERROR</b>: {esc(head)}: {esc(e.get("message"))}']
    if e.get("other_ranks"):
        parts.append(f"<br>ranks also stopped: {esc(', '.join(str(r) for r in e['other_ranks']))}")
    parts.append("</div>")
    if e.get("traceback"):
        parts.append(f"<h3>traceback</h3>{pre(e['traceback'].rstrip())}")
    return Raw("".join(parts))


# -- the compared tensors ----------------------------------------------------------------------


def _bad(figures: dict) -> str:
    return f"{figures['n_bad']}/{figures.get('numel', '?')}" if "n_bad" in figures else "-"


def _anchor(tag: str, tensor: str) -> str:
    return "tensor-" + tag + re.sub(r"[^A-Za-z0-9_-]+", "-", tensor)


def _group(result: dict, group: dict | None, output_dir: str | None) -> list[str]:
    """The verdicts of the run (group None), or of one of its TP or EP groups (dp > 1: each group's
    own tables and grids, its ranks named in the group and in the world)."""
    if group is None:
        out = _verdicts(result.get("verdicts", []), "verdicts", output_dir, result, "", "", integrity=result.get("integrity"))
        if "recomputed_verdicts" in result:
            out += _verdicts(result["recomputed_verdicts"], "against the golden recomputed from the snapshot's in/",
                             output_dir, result, "recomputed_", "recomputed_")
        return out + _integrity(result.get("integrity"), "integrity", "")
    n, ranks = group["group"], group["ranks"]
    # The PNGs of report.plots=true are those of the top level: the first group that failed.
    png = "" if group["verdicts"] == result.get("verdicts") else None
    heading = (f"group {n} (global ranks {ranks[0]}-{ranks[-1]}, seed {group['seed']}): "
               f"{'PASS' if group['passed'] else 'FAIL'}")
    out = _verdicts(group["verdicts"], heading, output_dir, result, f"group{n}_", png, ranks, group.get("integrity"))
    if "recomputed_verdicts" in group:
        out += _verdicts(group["recomputed_verdicts"], f"group {n} against the golden recomputed from the snapshot's in/",
                         output_dir, result, f"group{n}_recomputed_", None if png is None else "recomputed_", ranks)
    return out + _integrity(group.get("integrity"), f"group {n} integrity", f"group{n}_")


def _verdicts(verdicts: list[dict], heading: str, output_dir: str | None, result: dict, tag: str, png: str | None,
              global_ranks: list[int] | None = None, integrity: dict | None = None) -> list[str]:
    """A table of verdicts and each failing one's account and grids. `tag` keeps the anchors of
    the page apart; `png`: the tag of the report.plots=true PNGs these grids were written as (None:
    none were); `global_ranks`: a group's ranks in the world; `integrity`: the integrity entry
    beside these verdicts, each tensor's integrity verdict shown in its row."""
    failing = {}  # tensor -> its failing integrity checks
    for c in (integrity or {}).get("checks", []) + (integrity or {}).get("recomputed_checks", []):
        failing.setdefault(c["tensor"], set())
        if not c["passed"]:
            failing[c["tensor"]].add(c["check"])
    rows, attrs = [], []
    for v in verdicts:
        f = v.get("figures", {})
        word = "PASS" if v["passed"] else "FAIL"
        name = v["tensor"] if v["passed"] else link(f"#{_anchor(tag, v['tensor'])}", v["tensor"])
        broken = failing.get(v["tensor"])
        held = ("-" if broken is None else "ok" if not broken
                else Raw(f'{badge("FAIL", big=False)} '
                         f'{link("#" + _anchor(tag + "integrity_", v["tensor"] + "-" + min(broken)), ", ".join(sorted(broken)))}'))
        rows.append([name, "all", Raw(badge(word, big=False) + (" (diagnostic)" if v.get("diagnostic") else "")), held,
                     _bad(f), fmt(f.get("max_abs_diff")), fmt(f.get("worst")),
                     Raw(f'<span class="label">{esc(comparator_text(v))}</span>')])
        attrs.append(f'class="tensor" data-tensor="{esc(v["tensor"])}" data-verdict="{word}" '
                     f'data-integrity="{"-" if broken is None else "FAIL" if broken else "PASS"}"')
        for pr in v.get("per_rank", []):
            rank = pr["rank"] if global_ranks is None else f"{pr['rank']} (global {global_ranks[pr['rank']]})"
            rows.append(["", rank, "ok" if not pr.get("n_bad") else "bad", "", _bad(pr), fmt(pr.get("max_abs_diff")),
                         fmt(pr.get("worst")), ""])
            attrs.append('class="sub"')
    out = [f"<h2>{esc(heading)}</h2>",
           table(["tensor", "rank", "reference", "integrity", "bad/numel", "max|diff|", "worst", "comparator"], rows,
                 row_attrs=attrs, numeric=(4, 5, 6), attrs=f'id="{tag or "primary"}-verdicts"')]
    for v in verdicts:
        if not v["passed"]:
            out += _failing(v, output_dir, result, tag, png)
    return out


def _failing(v: dict, output_dir: str | None, result: dict, tag: str, png: str | None) -> list[str]:
    out = [f'<h3 id="{_anchor(tag, v["tensor"])}">{badge("FAIL", big=False)} {esc(v["tensor"])}</h3>',
           f'<div class="label">{esc(v["label"])}</div>']
    if v.get("category"):
        out.append(f"<p>category: {esc(v['category'])}</p>")
    if v.get("detail"):
        out.append("<p>The comparator's account:</p>" + pre(v["detail"]))
    grids = [g for g in v.get("where") or [] if any(map(any, g["bad"]))]
    written = {os.path.basename(p) for p in result.get("plots") or []}
    for g in grids:
        name = plots.heatmap_file(png, v["tensor"], g) if png is not None else None
        path = os.path.join(output_dir, name) if output_dir and name in written else None
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                draw = f.read()  # report.plots=true drew it already: the same image
        else:
            path, draw = None, (lambda t=v["tensor"], g=g: plots.heatmap(t, g))
        out.append(figure(draw, f"{v['tensor']} {g['name']} heat map",
                          f"{v['tensor']}: bad points per {g['name']}" + (f" ({name})" if path else "")))
    if grids:
        text = "\n".join(where_lines(v))
        opened = "" if plots.available() else " open"
        out.append(f"<details{opened}><summary>where the bad points are, as text</summary>{pre(text)}</details>")
    return out


def _integrity(entry: dict | None, heading: str, tag: str) -> list[str]:
    """The integrity checks beside the reference verdicts: their verdict, a table of tensors x
    checks (whatever checks the run recorded), each failing check's account."""
    if entry is None:
        return []
    out = [f'<h2 id="{tag}integrity">{esc(heading)}</h2>']
    if not entry.get("enabled"):
        return out + [note("integrity=false: the integrity checks did not run; the reference comparators alone "
                           "decide, and the verdict names this as loosened.")]
    against = [(c, "") for c in entry.get("checks", [])]
    against += [(c, " (against the golden recomputed from in/)") for c in entry.get("recomputed_checks", [])]
    if not against:
        return out + ["<p>No integrity check applies here: a focused scope's stage checks allow no bad point.</p>"]
    word = "PASS" if all(c["passed"] for c, _ in against) else "FAIL"
    out.append(f'<p id="{tag}integrity-verdict">{badge(word, big=False)} integrity: {len(against)} checks, '
               f"{sum(not c['passed'] for c, _ in against)} failed</p>")
    names = check_names([c for c, _ in against])
    cells: dict[str, dict[str, Raw | str]] = {}
    for c, where in against:
        f = c.get("figures") or {}
        cell = f"{f.get('n_bad', '?')}/{f.get('numel', '?')}{where and ' (recomputed)'}"
        if not c["passed"]:
            cell = Raw(f'{badge("FAIL", big=False)} {link("#" + _anchor(tag + "integrity_", c["tensor"] + "-" + c["check"]), cell)}')
        cells.setdefault(c["tensor"], {})[c["check"]] = cell
    rows = [[t, *(got.get(n, "-") for n in names)] for t, got in cells.items()]
    out.append(table(["tensor", *names], rows, attrs=f'id="{tag}integrity-table"'))
    for c, where in against:
        if not c["passed"]:
            out += [f'<h3 id="{_anchor(tag + "integrity_", c["tensor"] + "-" + c["check"])}">{badge("FAIL", big=False)} '
                    f'{esc(c["tensor"])} integrity {esc(c["check"])}{esc(where)}</h3>',
                    f"<p>{esc(c.get('summary'))}</p>", pre(c.get("detail") or "")]
    return out


# -- where the time goes -----------------------------------------------------------------------


def _phase_times(result: dict) -> list[str]:
    secs = result["rank_seconds"]
    phases = [p for p in RANK_PHASES if any(p in (r or {}) for r in secs)]
    rss = result.get("rank_peak_rss_mib") or []
    cpu = result.get("rank_cpu_seconds") or []  # absent from a result.json written before it was
    rows = []
    for rank, r in enumerate(secs):
        r = r or {}
        rows.append([rank, *(fmt(r[p]) if p in r else "-" for p in phases), f"{sum(r.values()):.3g}",
                     f"{sum(cpu[rank].values()):.3g}" if rank < len(cpu) and cpu[rank] else "-",
                     fmt(rss[rank]) if rank < len(rss) else "-"])
    head = ["rank", *phases, "total", "CPU s", "peak RSS MiB"]
    return ["<h2>phase times per rank</h2>",
            svg_figure(lambda: svg.phase_times(secs), "phase times per rank",
                   "seconds each rank spent in each of its phases; CPU s: the CPU time of the rank's "
                   "process (all its threads) over those phases"),
            table(head, rows, numeric=range(1, len(head)), attrs='id="phase-times"')]


def _bisect(report: dict) -> list[str]:
    if report.get("diverged"):
        ranks = ", ".join(str(r) for r in report.get("ranks", []))
        head = (f"first divergence at stage '{report['stage']}' on rank {report['rank']} (ranks {ranks}), "
                f"tensor {report['tensor']}: {report['label']} ({report['mode']})")
    else:
        head = "no stage diverges in the staged re-run (the failure did not reproduce)"
    n_ranks = max((len(row.get("per_rank", [])) for row in report.get("stages", [])), default=0)
    rows, attrs = [], []
    for row in report.get("stages", []):
        word = {True: "pass", False: "FAIL", None: "-"}[row.get("passed")]
        dists = [_chain_distance(cell) for cell in row.get("per_rank", [])]
        dists += ["-"] * (n_ranks - len(dists))
        rows.append([row["stage"], word, ",".join(sorted(set(row.get("modes", [])))), *dists,
                     ", ".join(str(r) for r in row.get("failed_ranks", [])) or "-"])
        attrs.append('class="hit"' if report.get("diverged") and row["stage"] == report.get("stage") else "")
    out = ["<h2>bisect</h2>", f'<p id="bisect-verdict">{esc(head)}</p>']
    if report.get("detail"):
        out.append(pre(report["detail"]))
    out.append("<p>Per rank: the stage's max |diff| to the golden chain (0: bitwise equal, -: not compared).</p>")
    head_row = ["stage", "result", "modes", *(f"rank {r}" for r in range(n_ranks)), "failing ranks"]
    out.append(table(head_row, rows, row_attrs=attrs, numeric=range(3, 3 + n_ranks), attrs='id="bisect"'))
    return out


def _chain_distance(cell: dict) -> str:
    """A stage's distance to the golden chain on one rank: 0 bitwise, its max |diff|, '-' none."""
    chains = [t["chain"] for t in cell.get("tensors", []) if t.get("chain")]
    if not chains:
        return "-"
    if all(c.get("bitwise") for c in chains):
        return "0"
    return fmt(max(c.get("max_abs_diff", float("nan")) for c in chains))


# -- a benchmark -------------------------------------------------------------------------------

_STATS = ("min_s", "median_s", "mean_s", "max_s")


def _seconds(value) -> str:
    if not isinstance(value, (int, float)):
        return fmt(value)
    return f"{value * 1e3:.3g} ms" if abs(value) < 1.0 else f"{value:.3g} s"


def _count(n, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def _bench(bench: dict, output_dir: str | None) -> list[str]:
    """`launcher.run.bench_rounds.summarize`'s figures: the rounds (each its slowest rank), each rank's,
    a histogram of the rounds, each stage's share, the profiler traces."""
    out = ["<h2>benchmark</h2>",
           f"<p>{_count(bench.get('rounds'), 'timed round')} after {_count(bench.get('warmup'), 'warm-up round')}; "
           "a round's time is its slowest rank's.</p>",
           table(["of the rounds", "time"], [[k.removesuffix("_s"), _seconds(bench.get(k))] for k in _STATS],
                 numeric=(1,), attrs='id="bench"')]
    per_rank = bench.get("per_rank") or []
    if per_rank:
        rows = [[pr.get("rank", i), *(_seconds(pr.get(k)) for k in _STATS)] for i, pr in enumerate(per_rank)]
        out.append(table(["rank", *(k.removesuffix("_s") for k in _STATS)], rows, numeric=range(1, 5),
                         attrs='id="bench-ranks"'))
    if plots.round_times(bench):
        out.append(figure(lambda: plots.bench_histogram(bench), "histogram of the benchmark rounds",
                          "the timed rounds, each its slowest rank's time"))
    stages = bench.get("stages") or []
    if stages:
        total = sum(s["median_s"] for s in stages) or 1.0
        n_ranks = max(len(s.get("per_rank_median_s", [])) for s in stages)
        rows = [[s["stage"], "collective" if s.get("collective") else "", _seconds(s["median_s"]),
                 f"{100 * s['median_s'] / total:.0f}%", *(_seconds(v) for v in s.get("per_rank_median_s", []))]
                for s in stages]
        out += ["<h3>where a round's time goes</h3>",
                figure(lambda: plots.bench_stages(stages), "benchmark time per stage",
                       "each stage's median of its slowest rank per round; collectives apart"),
                table(["stage", "kind", "median (slowest rank)", "share", *(f"rank {r} median" for r in range(n_ranks))],
                      rows, numeric=range(2, 4 + n_ranks), attrs='id="bench-stages"')]
    if bench.get("profiles"):
        links = [link(relative(os.path.join(output_dir, p), output_dir) if output_dir else p, p) for p in bench["profiles"]]
        out.append(f"<p>torch.profiler traces (Chrome trace format; open in Perfetto or chrome://tracing): "
                   f"{Raw(' · '.join(links))}</p>")
    return out


# -- the logs ----------------------------------------------------------------------------------


def _logs(result: dict, output_dir: str | None) -> list[str]:
    out = ["<h2>logs</h2>"]
    if output_dir is None:
        return []
    failed = (result.get("error") or {}).get("log_dir")
    failed_dir = os.path.normpath(failed) if failed else None
    log_dir = result.get("log_dir") or (result.get("error") or {}).get("log_dir")
    rank_dirs = []
    if log_dir:
        rank_dirs = glob.glob(os.path.join(log_dir, "*", "attempt_*", "*")) + glob.glob(os.path.join(log_dir, "attempt_*", "*"))
        if os.path.isfile(os.path.join(log_dir, "stderr.log")):  # the failed rank's own folder
            rank_dirs.append(log_dir)
    rank_dirs = sorted({os.path.normpath(d) for d in rank_dirs if os.path.isdir(d)},
                       key=lambda d: (d.split(os.sep)[-2], int(d.split(os.sep)[-1]) if d.split(os.sep)[-1].isdigit() else 0))
    attempts = {d.split(os.sep)[-2] for d in rank_dirs}
    local = "local rank" if result.get("node_rank") else "rank"
    rows = []
    for d in rank_dirs:
        name = os.path.basename(d)
        label = f"{local} {name}" + (f" ({d.split(os.sep)[-2]})" if len(attempts) > 1 else "")
        files = [link(relative(os.path.join(d, f), output_dir), f) for f in ("stdout.log", "stderr.log", "error.json")
                 if os.path.isfile(os.path.join(d, f))]
        rows.append([label, Raw(" · ".join(files)) if files else "no log file", "failed here" if d == failed_dir else ""])
    if rows:
        out.append(table(["rank", "logs", "note"], rows, attrs='id="logs"'))
    elif result["status"] in ("config-error", "skipped"):
        out.append("<p>No rank ran, so there are no rank logs.</p>")
    else:
        out.append(f"<p>No rank log found{' under ' + esc(log_dir) if log_dir else ''}.</p>")
    launcher_log = os.path.join(output_dir, "launcher.log")
    if os.path.isfile(launcher_log):
        out.append(f"<p>The launcher's own log: {link('launcher.log', 'launcher.log')}</p>")
    return out
