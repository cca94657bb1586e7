"""The run's result: a JSON-ready dict (`result.json`) and its console rendering.

A result is `status` ("ok" or "error"), `passed`, the case, per-tensor verdicts with pooled
and per-rank figures, per-rank stage times, and on error the root-cause rank, stage, message,
traceback and log folder. Rendering never needs anything but that dict.

A run that never reached the ranks still leaves a result, so that every job of a sweep has
one: status "config-error" (refused by the preflight), "skipped" (a sweep with fail_fast after
a failed job) or "error" with stage "launcher" (the launcher process itself raised).

Where the errors are: a failing verdict may carry `where`, the grids of `launcher.heatmap`
(bad points per rank x token block / hc copy / physical block); they render as text under
the verdict's detail and, with `report.plots=true`, as PNG heat maps next to result.json.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import traceback

import torch

from . import heatmap
from .config.schema import RunSpec
from .run.launch import LaunchOutcome

STAGES = ("fixture", "golden", "save", "layer", "gather", "compare", "bisect")


def _case_dict(spec: RunSpec) -> dict:
    c = spec.case
    return {
        "layer": c.layer,
        "scope": c.scope,
        "model": c.model.name,
        "tp": c.tp,
        "local_t": c.local_t,
        "seed": c.seed,
        "start_pos": list(c.start_pos) if isinstance(c.start_pos, tuple) else c.start_pos,
        "backend": spec.backend,
        "impl": spec.impl.get("_target_"),
    }


def build_result(spec: RunSpec, outcome: LaunchOutcome, *, wall_s: float) -> dict:
    result = {
        "case": _case_dict(spec),
        "model_fields": spec.case.model.fields(),
        "torch": torch.__version__,
        "host": platform.node(),
        "wall_s": round(wall_s, 3),
        "log_dir": outcome.log_dir,
    }
    if outcome.failure is not None:
        result.update(status="error", passed=False, error=dataclasses.asdict(outcome.failure))
        return result
    r = outcome.result
    result["node_rank"] = spec.node_rank
    if r["comparisons"] is None:  # a node without rank 0: the verdict rank 0 broadcast
        result.update(status="ok", passed=bool(r["passed"]), verdicts=[], compared_on_node=0)
        return result
    # The primary reference is the snapshot when one is replayed, else the computed golden.
    primary = "snapshot" if "snapshot" in r["comparisons"] else "golden"
    result.update(
        status="ok", passed=bool(r["passed"]), reference=primary, verdicts=r["comparisons"][primary],
        rank_seconds=r["rank_seconds"], golden_cache_hits=r["golden_cache_hits"],
        golden_cache_problems=r["golden_cache_problems"], rank_peak_rss_mib=r["rank_peak_rss_mib"],
        golden_data=spec.golden_data, save_data=spec.save_data,
    )
    if r.get("bisect") is not None:
        result["bisect"] = r["bisect"]
    if primary == "snapshot" and "golden" in r["comparisons"]:
        result["recomputed_verdicts"] = r["comparisons"]["golden"]
    return result


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(result: dict) -> str:
    c = result["case"]
    lines = [
        f"dsv4-tp-harness  layer={c['layer']} scope={c.get('scope', 'full')} model={c['model']} tp={c['tp']} local_t={c['local_t']} "
        f"seed={c['seed']} start_pos={c['start_pos']} backend={c['backend']} impl={c['impl']}"
    ]
    if result["status"] in ("config-error", "skipped"):  # no rank ran
        word = "error" if result["status"] == "config-error" else "SKIPPED"
        lines.append(f"{word}: {result['error']['message']}")
        lines.append(f"VERDICT: {'ERROR' if word == 'error' else 'SKIPPED'} ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    if result["status"] == "error":
        e = result["error"]
        stage = f" in stage '{e['stage']}'" if e["stage"] else ""
        if e["rank"] is None:  # no rank ran: the launcher process itself failed
            lines.append(f"ERROR: the launcher failed{stage}: {e['message']}")
        else:
            lines.append(f"ERROR: rank {e['rank']} failed{stage} (exit code {e['exitcode']}): {e['message']}")
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
        verdict = "PASS" if result["passed"] else "FAIL"
        lines.append(f"node {result['node_rank']}: rank 0 on node 0 compared; its verdict: {verdict}")
        lines.append(f"VERDICT: {verdict} ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    secs = result["rank_seconds"]
    stage_cells = [f"{s} {max((r or {}).get(s, 0.0) for r in secs):.2f}" for s in STAGES if any(s in (r or {}) for r in secs)]
    rss = result.get("rank_peak_rss_mib") or []
    peak = f"; peak RSS {max(rss):.0f} MiB (rank {rss.index(max(rss))})" if rss else ""
    lines.append("stages (s, slowest rank): " + " | ".join(stage_cells) + peak)
    lines.append(_reference_line(result))
    lines += _verdict_lines(result["verdicts"])
    if "recomputed_verdicts" in result:
        lines.append("against the golden recomputed from the snapshot's in/:")
        lines += _verdict_lines(result["recomputed_verdicts"])
    if result.get("bisect"):
        from .verify.bisect import render as render_bisect  # the stage table of a bisected failure

        lines += render_bisect(result["bisect"]).splitlines()
    verdict = "PASS" if result["passed"] else "FAIL"
    failed = sorted({v["tensor"] for v in result["verdicts"] + result.get("recomputed_verdicts", []) if not v["passed"]})
    lines.append(f"VERDICT: {verdict}" + (f" {failed}" if failed else "") + f" ({result['wall_s']:.1f}s)")
    return "\n".join(lines)


def _reference_line(result: dict) -> str:
    if result.get("reference") == "snapshot":
        return f"reference: snapshot {result['golden_data']}/out"
    hits = result.get("golden_cache_hits", [])
    cached = f" (from the golden cache on ranks {hits})" if hits else ""
    problems = "".join(f"; warning: golden cache {p}" for p in result.get("golden_cache_problems", []))
    saved = f"; snapshot saved to {result['save_data']}" if result.get("save_data") else ""
    return f"reference: golden{cached}{saved}{problems}"


def _verdict_lines(verdicts: list[dict]) -> list[str]:
    rows = [["tensor", "rank", "verdict", "bad/numel", "max|diff|", "worst", "comparator"]]
    for v in verdicts:
        f = v.get("figures", {})
        rows.append([v["tensor"], "all", "PASS" if v["passed"] else "FAIL", _bad(f), _fmt(f.get("max_abs_diff")), _fmt(f.get("worst")), v["label"]])
        for pr in v.get("per_rank", []):
            rows.append(["", str(pr["rank"]), "ok" if not pr.get("n_bad") else "bad", _bad(pr), _fmt(pr.get("max_abs_diff")), _fmt(pr.get("worst")), ""])
    lines = _table(rows)
    for v in verdicts:
        if not v["passed"]:
            lines.append(f"{v['tensor']} FAIL ({v['label']})")
            lines += v["detail"].splitlines()
            lines += where_lines(v)
    return lines


def _bad(figures: dict) -> str:
    if "n_bad" not in figures:
        return "-"
    return f"{figures['n_bad']}/{figures.get('numel', '?')}"


# -- results of runs that never reached the ranks ----------------------------------------------


def config_case(cfg) -> dict:
    """The case as the config states it, for a run refused before a RunSpec exists.

    Each key separately: one value that cannot be read (a bad interpolation) must not hide
    the others.
    """

    def get(read):
        try:
            v = read()
        except Exception:  # any unreadable value: the preflight message says why
            return None
        return list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v

    return {
        "layer": get(lambda: cfg.layer.name),
        "scope": get(lambda: cfg.scope),
        "model": get(lambda: cfg.model.name),
        "tp": get(lambda: cfg.tp),
        "local_t": get(lambda: cfg.local_t),
        "seed": get(lambda: cfg.seed),
        "start_pos": get(lambda: cfg.start_pos),
        "backend": get(lambda: cfg.backend),
        "impl": get(lambda: cfg.impl["_target_"]),
    }


def not_launched(case: dict, status: str, message: str, *, wall_s: float, stage: str | None = None,
                 trace: str = "") -> dict:
    """The result of a run that started no rank (status config-error, skipped or error)."""
    return {
        "case": case,
        "torch": torch.__version__,
        "host": platform.node(),
        "wall_s": round(wall_s, 3),
        "status": status,
        "passed": False,
        "error": {"rank": None, "stage": stage, "message": message, "traceback": trace, "exitcode": None,
                  "log_dir": None, "other_ranks": []},
    }


def launcher_error(case: dict, exc: BaseException, *, wall_s: float) -> dict:
    """The result of a run whose launcher process raised (a bug or a broken environment)."""
    trace = "".join(traceback.format_exception(exc))
    return not_launched(case, "error", f"{type(exc).__name__}: {exc}", wall_s=wall_s, stage="launcher", trace=trace)


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
            lines += ["    " + ln for ln in _table(rows)]
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
                     f"{g['bad'][r][c]}/{g['numel'][r][c]} bad, max|diff| {_fmt(g['max_abs_diff'][r][c])}")
    return lines


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
            heatmap.write_png(path, g["bad"])
            paths.append(path)
    return paths
