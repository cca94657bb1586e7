"""The run's result: a JSON-ready dict (`result.json`) and its console rendering.

A result is `status` ("ok" or "error"), `passed`, the case, per-tensor verdicts with pooled
and per-rank figures, per-rank stage times, and on error the root-cause rank, stage, message,
traceback and log folder. Rendering never needs anything but that dict.
"""

from __future__ import annotations

import dataclasses
import platform

import torch

from .launch import LaunchOutcome
from .schema import RunSpec

STAGES = ("fixture", "golden", "save", "layer", "gather", "compare")


def _case_dict(spec: RunSpec) -> dict:
    c = spec.case
    return {
        "layer": c.layer,
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
    # The primary reference is the snapshot when one is replayed, else the computed golden.
    primary = "snapshot" if "snapshot" in r["comparisons"] else "golden"
    result.update(
        status="ok", passed=bool(r["passed"]), reference=primary, verdicts=r["comparisons"][primary],
        rank_seconds=r["rank_seconds"], golden_cache_hits=r["golden_cache_hits"],
        golden_data=spec.golden_data, save_data=spec.save_data,
    )
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
        f"dsv4-tp-harness  layer={c['layer']} model={c['model']} tp={c['tp']} local_t={c['local_t']} "
        f"seed={c['seed']} start_pos={c['start_pos']} backend={c['backend']} impl={c['impl']}"
    ]
    if result["status"] == "error":
        e = result["error"]
        stage = f" in stage '{e['stage']}'" if e["stage"] else ""
        lines.append(f"ERROR: rank {e['rank']} failed{stage} (exit code {e['exitcode']}): {e['message']}")
        if e["traceback"]:
            tail = [ln for ln in e["traceback"].rstrip().splitlines() if ln.strip() and " at t=" not in ln][-8:]
            lines += ["  " + ln for ln in tail]
        if e["other_ranks"]:
            lines.append(f"  ranks also stopped: {e['other_ranks']}")
        lines.append(f"  log: {e['log_dir'] or result['log_dir']}")
        lines.append(f"VERDICT: ERROR ({result['wall_s']:.1f}s)")
        return "\n".join(lines)
    secs = result["rank_seconds"]
    stage_cells = [f"{s} {max((r or {}).get(s, 0.0) for r in secs):.2f}" for s in STAGES if any(s in (r or {}) for r in secs)]
    lines.append("stages (s, slowest rank): " + " | ".join(stage_cells))
    lines.append(_reference_line(result))
    lines += _verdict_lines(result["verdicts"])
    if "recomputed_verdicts" in result:
        lines.append("against the golden recomputed from the snapshot's in/:")
        lines += _verdict_lines(result["recomputed_verdicts"])
    verdict = "PASS" if result["passed"] else "FAIL"
    failed = sorted({v["tensor"] for v in result["verdicts"] + result.get("recomputed_verdicts", []) if not v["passed"]})
    lines.append(f"VERDICT: {verdict}" + (f" {failed}" if failed else "") + f" ({result['wall_s']:.1f}s)")
    return "\n".join(lines)


def _reference_line(result: dict) -> str:
    if result.get("reference") == "snapshot":
        return f"reference: snapshot {result['golden_data']}/out"
    hits = result.get("golden_cache_hits", [])
    cached = f" (from the golden cache on ranks {hits})" if hits else ""
    return f"reference: golden{cached}" + (f"; snapshot saved to {result['save_data']}" if result.get("save_data") else "")


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
    return lines


def _bad(figures: dict) -> str:
    if "n_bad" not in figures:
        return "-"
    return f"{figures['n_bad']}/{figures.get('numel', '?')}"
