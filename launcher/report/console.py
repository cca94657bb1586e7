"""The console report of a run: what `python -m launcher` prints after the ranks are done.

`render(result)` needs nothing but the result dict (`launcher.report.result`): the case line,
the slowest rank's stage times, the reference, a table of verdicts (pooled and per rank, by
each verdict's `tally`), each failing tensor's comparator account, where its errors are (the
grids of `launcher.verify.where`, as text), the integrity checks (a table, each failing one's
account, and the line that sets the reference verdict beside them), the bisect table when
there is one, and the verdict line.
`where_line` names the run's folder and page, printed after the report.
`fmt`, `starts_text` and `table_lines` are the formats the sweep's table and the HTML pages
share.
"""

from __future__ import annotations

import os

from layers.contract.case import GROUP_KEYS, LIST_KEYS, SCALAR_KEYS, key_set_columns

from launcher.config.rank_phases import RANK_PHASES
from launcher.report.bisect_lines import render as render_bisect
from launcher.report.result import failed_phase, verdict, verdict_pair
from launcher.report.verdict import check_names, decision, line as verdict_line


def fmt(v) -> str:
    """A figure in a table cell: '-' for none, 3 significant digits for a float."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def starts_text(start_pos) -> str:
    """A case's start positions in a table cell: the canonical set, one, or a list's first few."""
    if start_pos is None:
        return "canonical"
    if isinstance(start_pos, list):
        head = ",".join(str(s) for s in start_pos[:3])
        return f"[{head},...]({len(start_pos)})" if len(start_pos) > 3 else f"[{head}]"
    return str(start_pos)


def table_lines(rows: list[list[str]]) -> list[str]:
    """Rows of cells as left-aligned columns two spaces apart (the first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# The keys that define a case, in the order every report shows them: the layers' case-key sets
# (`layers.contract.case.CASE_KEYS`: group sizes, then their other keys, lists last), the
# prefill's keys.
CASE_KEYS = ("layer", "phase", "scope", "model", *GROUP_KEYS, "cp", "cp_layout", "prefix", "segment_lens", "dp",
             *SCALAR_KEYS, "seed", *LIST_KEYS, "backend", "impl")


def seed_text(seed) -> object:
    """A case's seed as every report shows it: `-` where none played a part (a replay of a
    snapshot that records none), not the config's default."""
    return "-" if seed is None else seed


def case_items(c: dict) -> list[tuple[str, object]]:
    """The case's keys and values that it has, in CASE_KEYS order; dp only where there are
    several groups."""
    return [(k, seed_text(c[k]) if k == "seed" else c[k]) for k in CASE_KEYS
            if k in c and not (k == "dp" and c[k] in (None, 1))]


def case_label(c: dict, *between: str) -> str:
    """The case's layer, the words `between`, then its group sizes, from its `describe()`:
    `swa tiny tp=4 local_t=128`, `moe tiny ep=2`, `block csa tiny tp=2 ep=4 local_t=64`,
    `swa prefill tiny cp=2`."""
    kind = c.get("attention") or (c["phase"] if c.get("phase", "decode") != "decode" else None)
    layer = f"{c['layer']} {kind}" if kind else c["layer"]
    sizes = [f"{k}={c[k]}" for k in ("tp", "ep", "cp", "local_t") if c.get(k) is not None]
    return " ".join([layer, *between, *sizes])


def group_text(c: dict) -> str:
    """The sizes of the case's process groups as keys (`tp=N`, `ep=P`, both for the block,
    `cp=N` for a prefill)."""
    sizes = [k for k in (*GROUP_KEYS, "cp") if c.get(k) is not None]
    return " ".join(f"{k}={c[k]}" for k in sizes) or f"{GROUP_KEYS[0]}={c.get(GROUP_KEYS[0])}"


def snapshot_line(snapshot: dict, case: dict) -> str:
    """The case a replay read from its snapshot, and which keys it read there."""
    read = snapshot["read"]
    shown = " ".join(f"{k}={v}" for k, v in case_items(case) if k not in ("backend", "impl"))
    model = snapshot.get("model") or {}
    dims = ""
    if model.get("name") == "snapshot":  # no preset has its dims: the dims it fixes
        dims = " (" + ", ".join(f"{n}={f['value']}" for n, f in model["fields"].items()) + ")"
    return (f"snapshot {snapshot['directory']}: {shown}{dims}; read from the snapshot: "
            f"{', '.join(read) if read else 'nothing'}")


def case_line(c: dict) -> str:
    """The case as `key=value` pairs (case_items)."""
    return "dsv4-tp-harness  " + " ".join(f"{k}={v}" for k, v in case_items(c))


def beyond_reference_line(c: dict) -> str:
    """What about the case the reference's kernels would refuse: its golden is ours alone."""
    return (f"beyond the reference: {'; '.join(c['beyond_reference'])} (its kernels would refuse this case; "
            f"the verdict is against this harness's golden alone)")


def case_columns(rows: list[dict]) -> list[str]:
    """The case keys a table of sweep jobs shows: each key set whose group key some job has (the
    first set where none has); dp where a job had several groups."""
    groups, scalars, lists = key_set_columns({frozenset(k for k in GROUP_KEYS if r.get(k) is not None) for r in rows})
    grouped = any((r.get("dp") or 1) > 1 for r in rows)
    return [*groups, *(["dp"] if grouped else []), *scalars, *lists]


# Run keys beside the case that a sweep's table shows where its jobs differ in them: two jobs
# of one case and two implementations read as two rows of one table.
VARIED_KEYS = ("impl", "backend")


def varied_columns(rows: list[dict]) -> list[str]:
    """The VARIED_KEYS whose value differs between the jobs of a sweep."""
    return [k for k in VARIED_KEYS if len({str(r.get(k)) for r in rows}) > 1]


def varying_keys(rows: list[dict]) -> list[str]:
    """The override keys whose value differs between the jobs (each row's `overrides`), in the
    order the first job names them; Hydra's own keys left out."""
    values: dict[str, set[str]] = {}
    for r in rows:
        given = dict(o.split("=", 1) if "=" in o else (o, "") for o in r.get("overrides") or [])
        for key in {*values, *given}:
            values.setdefault(key, set()).add(given.get(key, "(unset)"))
    return [k for k, v in values.items() if len(v) > 1 and not k.lstrip("+~").startswith("hydra")]


def render(result: dict) -> str:
    lines = [case_line(result["case"])]
    if result.get("snapshot"):
        lines.append(snapshot_line(result["snapshot"], result["case"]))
    if result["case"].get("beyond_reference"):
        lines.append(beyond_reference_line(result["case"]))
    if result["status"] in ("config-error", "skipped"):  # no rank ran
        word = "error" if result["status"] == "config-error" else "SKIPPED"
        lines.append(f"{word}: {result['error']['message']}")
        lines.append(f"VERDICT: {'ERROR' if word == 'error' else 'SKIPPED'} ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    if result["status"] == "error":
        e = result["error"]
        phase = f" in phase '{failed_phase(e)}'" if failed_phase(e) else ""
        if e["rank"] is None:  # no rank ran: the launcher process itself failed
            lines.append(f"ERROR: the launcher failed{phase}: {e['message']}")
        else:
            lines.append(f"ERROR: rank {e['rank']} failed{phase} (exit code {e['exitcode']}): {e['message']}")
        if e["traceback"]:
            tb = [ln for ln in e["traceback"].rstrip().splitlines() if ln.strip() and " at t=" not in ln]
            # A stack dump starts with the innermost frame; a Python traceback ends with it.
            tail = tb[:10] if "most recent call first" in e["traceback"] else tb[-8:]
            lines += ["  " + ln for ln in tail]
        if e["other_ranks"]:
            lines.append(f"  ranks also stopped: {e['other_ranks']}")
        if e["log_dir"] or result.get("log_dir"):
            lines.append(f"  log: {e['log_dir'] or result['log_dir']}")
        lines.append(f"VERDICT: ERROR ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    if "compared_on_node" in result:
        word = verdict(result)
        lines.append(f"node {result['node_rank']}: rank 0 on node 0 compared; its verdict: {word}")
        lines.append(f"VERDICT: {word} ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    secs = result["rank_seconds"]
    phase_cells = [f"{p} {max((r or {}).get(p, 0.0) for r in secs):.2f}" for p in RANK_PHASES if any(p in (r or {}) for r in secs)]
    rss = result.get("rank_peak_rss_mib") or []
    peak = f"; peak RSS {max(rss):.0f} MiB (rank {rss.index(max(rss))})" if rss else ""
    lines.append("phases (s, slowest rank): " + " | ".join(phase_cells) + peak)
    if result.get("bench"):
        lines += bench_lines(result["bench"])
    if result.get("unchecked"):
        lines.append("VERDICT: UNCHECKED (golden=false: a performance run; no golden was computed and nothing "
                     f"was compared) ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    lines.append(reference_line(result))
    tolerance = tolerance_line(result.get("tolerance"))
    if tolerance:
        lines.append(tolerance)
    if "groups" in result:  # several TP groups: each group's verdicts, its ranks named globally
        for g in result["groups"]:
            lines.append(f"group {g['group']} (global ranks {g['ranks'][0]}-{g['ranks'][-1]}, seed {g['seed']}): "
                         f"{'PASS' if g['passed'] else 'FAIL'}")
            lines += ["  " + ln for ln in _verdict_lines(g["verdicts"], g["ranks"]) + _integrity_lines(g["integrity"])]
    else:
        lines += _verdict_lines(result["verdicts"])
    if "recomputed_verdicts" in result:
        lines.append("against the golden recomputed from the snapshot's in/:")
        lines += _verdict_lines(result["recomputed_verdicts"])
    if "groups" not in result:
        lines += _integrity_lines(result["integrity"])
    lines.append(verdict_pair(result))
    if result.get("bisect"):
        lines += render_bisect(result["bisect"]).splitlines()
    lines.append(f"VERDICT: {verdict_line(decision(result, verdict(result)))} ({result['wall_s']:.1f}s)")
    return "\n".join(lines)


def where_line(output_dir: str, result: dict) -> str:
    """Where the run left its files: the folder, its page, a benchmark's profiler traces."""
    folder = os.path.abspath(output_dir)
    page = os.path.join(folder, "report.html")
    parts = [f"run folder: {folder}", f"page: {page}" if os.path.isfile(page) else "page: not written"]
    profiles = (result.get("bench") or {}).get("profiles")
    if profiles:
        parts.append("profiles: " + ", ".join(os.path.join(folder, p) for p in profiles))
    return "; ".join(parts)


def tolerance_line(tolerance: dict | None) -> str | None:
    """What the tolerance config changed, or None when it changed nothing."""
    if not tolerance:
        return None
    parts = []
    if tolerance["profile"] not in (None, "default"):
        parts.append(f"profile {tolerance['profile']}")
    for tensor, changed in tolerance["overridden"].items():
        parts.append(f"{tensor} " + ", ".join(f"{p}={c['value']} (default {c['default']})" for p, c in changed.items()))
    if tolerance["diagnostic"]:
        parts.append(f"diagnostic (never fail the run): {', '.join(tolerance['diagnostic'])}")
    if tolerance["not_applied"]:
        parts.append(f"not compared here, not applied: {', '.join(tolerance['not_applied'])}")
    return "tolerance: " + "; ".join(parts) if parts else None


def comparator_text(verdict: dict) -> str:
    """A verdict's effective comparator, its parameters that the tolerance config set marked."""
    changed = verdict.get("overridden") or {}
    marks = ", ".join(f"{p} {c['default']}->{c['value']}" for p, c in changed.items())
    return verdict["label"] + (f" [set: {marks}]" if marks else "")


def _verdict_word(verdict: dict) -> str:
    word = "PASS" if verdict["passed"] else "FAIL"
    return f"{word} (diagnostic)" if verdict.get("diagnostic") else word


def _ms(seconds: float) -> str:
    """A round's time, 3 significant digits, in ms below a second and in s above (never 3.4e+03 ms)."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def bench_lines(bench: dict) -> list[str]:
    """The benchmark in one line (the round's slowest rank), plus the stages' share when timed."""
    lines = [f"bench: {bench['rounds']} rounds after {bench['warmup']} warm-up, slowest rank per round: "
             f"min {_ms(bench['min_s'])} | median {_ms(bench['median_s'])} | mean {_ms(bench['mean_s'])} | "
             f"max {_ms(bench['max_s'])}"]
    stages = bench.get("stages")
    if stages:
        total = sum(s["median_s"] for s in stages) or 1.0
        cells = [f"{s['stage']}{' (collective)' if s['collective'] else ''} {_ms(s['median_s'])} "
                 f"{100 * s['median_s'] / total:.0f}%" for s in stages]
        lines.append("  stages (median of the slowest rank): " + " | ".join(cells))
    if bench.get("profiles"):
        lines.append(f"  profiles: {', '.join(bench['profiles'])}")
    return lines


def reference_line(result: dict) -> str:
    """Which reference the verdicts compare against: the golden (and from where) or a snapshot."""
    if result.get("reference") == "snapshot":
        return f"reference: snapshot {result['golden_data']}/out"
    hits, input_hits = result.get("golden_cache_hits", []), result.get("input_cache_hits", [])
    cached = f" (from the golden cache on ranks {hits})" if hits else ""
    inputs = f"; inputs from the golden cache on ranks {input_hits}" if input_hits else ""
    problems = "".join(f"; warning: golden cache {p}" for p in result.get("golden_cache_problems", []))
    saved = f"; snapshot saved to {result['save_data']}" if result.get("save_data") else ""
    return f"reference: golden{cached}{inputs}{saved}{problems}"


def _verdict_lines(verdicts: list[dict], global_ranks: list[int] | None = None) -> list[str]:
    """The verdicts' table; `global_ranks`: a TP group's ranks in the world, named beside the
    group's own rank numbers."""
    rows = [["tensor", "rank", "verdict", "bad/numel", "max|diff|", "worst", "comparator"]]
    for v in verdicts:
        t = v["tally"]
        rows.append([v["tensor"], "all", _verdict_word(v), _bad(t), fmt(t["max_abs_diff"]), fmt(t["worst"]),
                     comparator_text(v)])
        worst = {pr["rank"]: pr.get("worst") for pr in v.get("per_rank", [])}
        for pr in t["per_rank"]:
            rank = str(pr["rank"]) if global_ranks is None else f"{pr['rank']} (global {global_ranks[pr['rank']]})"
            rows.append(["", rank, "ok" if not pr["n_bad"] else "bad", _bad(pr), fmt(pr["max_abs_diff"]), fmt(worst.get(pr["rank"])), ""])
    lines = table_lines(rows)
    for v in verdicts:
        if not v["passed"]:
            diagnostic = ", diagnostic: never fails the run" if v.get("diagnostic") else ""
            lines.append(f"{v['tensor']} FAIL{diagnostic} ({comparator_text(v)})")
            lines += v["detail"].splitlines()
            lines += where_lines(v)
    return lines


def _bad(figures: dict) -> str:
    if figures.get("n_bad") is None:
        return "-"
    return f"{figures['n_bad']}/{figures.get('numel', '?')}"


def _integrity_lines(entry: dict) -> list[str]:
    """One row per tensor, one column per integrity check (bad/looked at), then the failures."""
    if not entry["enabled"]:
        return ["integrity: off (integrity=false: the reference comparators alone decide)"]
    if not entry["checks"]:
        return ["integrity: no checks here (a focused scope's stage checks allow no bad point: no budget to hide in)"]
    checks = [(c, "") for c in entry["checks"]]
    checks += [(c, " (against the golden recomputed from in/)") for c in entry.get("recomputed_checks", [])]
    cells: dict[str, dict[str, str]] = {}
    for c in entry["checks"]:
        f = c["figures"]
        cells.setdefault(c["tensor"], {})[c["check"]] = f"{f['n_bad']}/{f['numel']}" + ("" if c["passed"] else " FAIL")
    names = check_names(entry["checks"])
    rows = [["integrity", *names]] + [[t, *(got.get(k, "-") for k in names)] for t, got in cells.items()]
    lines = table_lines(rows)
    for c, against in checks:
        if not c["passed"]:
            lines.append(f"{c['tensor']} integrity {c['check']} FAIL{against}")
            lines += c["detail"].splitlines()
    return lines


# -- where the errors are ----------------------------------------------------------------------

GRID_MAX_COLS = 16  # wider grids list their cells with bad points instead of drawing every cell
LIST_MAX_CELLS = 12  # such cells listed per rank


def where_lines(verdict: dict) -> list[str]:
    """A failing verdict's grids as text: per rank, where its bad points are."""
    lines = []
    for g in verdict.get("where") or []:
        total = sum(map(sum, g["bad"]))
        if not total:
            continue
        each = f" ({g['cell']} each)" if g["cell"] else ""
        lines.append(f"  where: {verdict['tensor']}: {total} bad points per rank and {g['cols']}{each}")
        if len(g["col_labels"]) <= GRID_MAX_COLS:
            rows = [[g["cols"], *g["col_labels"]]]
            rows += [[f"rank {r}", *(str(v) if v else "." for v in row)] for r, row in enumerate(g["bad"])]
            lines += ["    " + ln for ln in table_lines(rows)]
        else:
            for r, row in enumerate(g["bad"]):
                cells = [(c, v) for c, v in enumerate(row) if v]
                if not cells:
                    lines.append(f"    rank {r}: none")
                    continue
                shown = ", ".join(f"{g['col_labels'][c]}: {v}" for c, v in cells[:LIST_MAX_CELLS])
                more = f", ... {len(cells) - LIST_MAX_CELLS} more" if len(cells) > LIST_MAX_CELLS else ""
                lines.append(f"    rank {r}: {sum(row)} in {len(cells)} of {len(row)} {g['cols']}s ({shown}{more})")
        r, c = max(((r, c) for r in range(len(g["bad"])) for c in range(len(g["bad"][r]))),
                   key=lambda rc: (g["bad"][rc[0]][rc[1]], g["max_abs_diff"][rc[0]][rc[1]]))
        lines.append(f"    worst: rank {r}, {g['cols']} {g['col_labels'][c]}: "
                     f"{g['bad'][r][c]}/{g['numel'][r][c]} bad, max|diff| {fmt(g['max_abs_diff'][r][c])}")
    return lines
