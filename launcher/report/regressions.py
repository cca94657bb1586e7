"""Regression tracking: two runs or sweeps, job by job (`python -m launcher.compare`).

A folder is a run folder (its `result.json`) or a sweep folder (its jobs' `result.json` files,
found as the sweep's summary finds them, `launcher.report.sweep_summary.collect_rows`, so a moved or
downloaded folder still reads; a job that left no result is an ERROR job without a case).
Jobs are matched by case (layer, scope, model, tp or ep and the MoE keys, dp, local_t, start
positions, seed), never by implementation or job number: comparing two implementations of
one case is the point. A case run twice in one sweep is matched in job order.

A regression, which makes the comparison exit 1:
* a job that passed in the baseline and does not now;
* a compared tensor whose max |diff| grew by more than `error_factor` (errors below
  `error_floor` count as the floor, so a bitwise baseline does not turn every rounding
  difference of another implementation into a regression);
* a benchmark median slower by more than `slower` (a fraction) where both runs have one;
* a candidate job that did not pass and matches no baseline job (a new case, or one refused
  before its case was known): nothing shows it failed before;
* a baseline job that passed and matches no candidate job: a case the candidate no longer
  runs is not a case that still passes.

Results are read in this tool's layouts only (`schema_version` 1 and 2, `launcher.report.result`): a
result.json of another version, or one that lacks what a result holds, is a CompareError
naming the file, never a comparison of whatever keys happen to be there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from layers.contract.case import GROUP_KEYS, LIST_KEYS, SCALAR_KEYS

from launcher.report.console import fmt, seed_text, table_lines
from launcher.report.result import READABLE_SCHEMA_VERSIONS, verdict
from launcher.report.sweep_summary import collect_rows, job_row

# The keys that define a case; `impl`, `backend` and the job number do not.
CASE_KEYS = ("layer", "phase", "cp", "cp_layout", "prefix", "segment_lens", "scope", "model", *GROUP_KEYS, "dp", *SCALAR_KEYS, *LIST_KEYS, "seed")
NOT_PASSED = ("FAIL", "ERROR", "SKIP")


class CompareError(ValueError):
    """A folder that holds neither a run nor a sweep, or a result this tool cannot read."""


@dataclass
class Job:
    """One job of a run or sweep folder: its case, verdict, per-tensor errors and bench median."""

    label: str  # the run folder, or `job N` of a sweep
    case: dict | None  # None: the job left no result
    verdict: str
    errors: dict[str, float | None] = field(default_factory=dict)  # "tensor" or "group g/tensor" -> max |diff|
    bench_median_s: float | None = None
    message: str = ""
    # Its null seed is a value, not a key left unknown: it replayed a snapshot that records
    # none, so it matches only a job that did the same, never a seeded run of the same dims.
    seedless: bool = False

    def key(self) -> tuple:
        if not self.case:
            return ()
        return tuple("-" if k == "seed" and self.seedless else _hashable(self.case.get(k)) for k in CASE_KEYS)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def _tensor_errors(result: dict) -> dict[str, float | None]:
    """Each compared tensor's max |diff| (NaN when it has non-finite values), per TP group
    where there are several."""
    groups = result.get("groups") or [{"group": None, "verdicts": result.get("verdicts") or []}]
    errors = {}
    for g in groups:
        prefix = "" if g["group"] is None else f"group {g['group']}/"
        for v in (g.get("verdicts") or []) + (g.get("recomputed_verdicts") or []):
            figures = v.get("figures") or {}
            nonfinite = figures.get("nan_actual") or figures.get("inf_actual")
            value = figures.get("max_abs_diff")
            errors[prefix + v["tensor"]] = math.nan if nonfinite else value
    return errors


def job_of(label: str, result: dict | None, message: str = "") -> Job:
    if result is None:
        return Job(label=label, case=None, verdict="ERROR", message=message or "it left no result.json")
    case = dict(result.get("case") or {})
    case.setdefault("dp", 1)
    bench = result.get("bench") or {}
    row = job_row(0, [], label, result)
    return Job(label=label, case=case, verdict=verdict(result), errors=_tensor_errors(result),
               bench_median_s=bench.get("median_s"), message=row.get("message") or "",
               seedless=bool(result.get("snapshot")) and case.get("seed") is None)


def _check_layout(path: str, result) -> None:
    """Refuse a result that is not of a schema_version this tool reads."""
    if not isinstance(result, dict) or result.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        written = result.get("schema_version") if isinstance(result, dict) else None
        raise CompareError(f"{path}: schema_version {written}, this tool reads schema_version "
                           f"{' and '.join(map(str, READABLE_SCHEMA_VERSIONS))} only (compare it with the version that wrote it)")


def _readable_job(path: str, label: str, result: dict | None, message: str = "") -> Job:
    """`job_of` for a result read from `path`, refused unless it is of this tool's layout."""
    if result is not None:
        _check_layout(path, result)
    try:
        return job_of(label, result, message)
    except (KeyError, TypeError, AttributeError) as e:
        raise CompareError(f"{path}: not a result of this tool's layout ({type(e).__name__}: {e})") from e


def load(path: str) -> list[Job]:
    """The jobs of a run folder or a sweep folder."""
    if not os.path.isdir(path):
        raise CompareError(f"{path} is not a folder (give a run folder with result.json or a sweep folder)")
    is_sweep = any(os.path.isfile(os.path.join(path, f)) for f in ("sweep.json", "summary.json"))
    if not is_sweep:
        result_path = os.path.join(path, "result.json")
        if not os.path.isfile(result_path):
            raise CompareError(f"{path} holds no result.json, sweep.json or summary.json: not a run or sweep folder")
        return [_readable_job(result_path, path, _read(result_path))]
    try:
        rows = collect_rows(path, check=_check_layout)
    except (KeyError, TypeError, AttributeError) as e:  # a job's result that lacks what a result holds
        raise CompareError(f"{path}: a job's result.json is not of this tool's layout (schema_version "
                           f"{' or '.join(map(str, READABLE_SCHEMA_VERSIONS))}; {type(e).__name__}: {e})") from e
    jobs = []
    for row in rows:
        folder = row["output_dir"]
        result_path = os.path.join(folder, "result.json") if folder not in ("-", None) else None
        result = _read(result_path) if result_path else None
        jobs.append(_readable_job(result_path or path, f"job {row['job']}", result, row.get("message", "")))
    if not jobs:
        raise CompareError(f"{path} is a sweep folder without any job")
    return jobs


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CompareError(f"{path} cannot be read as JSON: {e}") from e


def _compatible(unknown: Job, known: Job) -> bool:
    """A job refused before its case was complete (a key left to its default reads None)
    against a job whose case is known: every key it does state agrees."""
    return all(u is None or u == k for u, k in zip(unknown.key(), known.key()))


def match(baseline: list[Job], candidate: list[Job]) -> tuple[list[tuple[Job, Job]], list[Job], list[Job]]:
    """Pairs (baseline, candidate) by case, in job order; then the unmatched of each side."""
    left, right = list(baseline), list(candidate)
    pairs = []
    for exact in (True, False):
        for c in list(right):
            if c.case is None:
                continue
            found = next((b for b in left if b.case is not None and
                          (b.key() == c.key() if exact else _compatible(c, b) or _compatible(b, c))), None)
            if found is not None:
                pairs.append((found, c))
                left.remove(found)
                right.remove(c)
    return pairs, left, right


@dataclass(frozen=True)
class Thresholds:
    error_factor: float = 2.0  # a tensor's max |diff| may grow by this factor
    error_floor: float = 1e-4  # errors below it count as it
    slower: float = 0.10  # a benchmark median may be this fraction slower


def _grew(then: float | None, now: float | None, t: Thresholds) -> bool:
    if now is None:
        return False  # nothing compared now: the verdict says whether that is a regression
    if math.isnan(now):
        return then is None or not math.isnan(then)
    if then is None or math.isnan(then):
        return False
    return max(now, t.error_floor) > t.error_factor * max(then, t.error_floor)


def compare_pair(b: Job, c: Job, t: Thresholds) -> dict:
    """One matched job: its verdicts, tensors and medians then and now, and its regressions."""
    regressions = []
    if b.verdict == "PASS" and c.verdict != "PASS":
        regressions.append(f"verdict PASS -> {c.verdict}" + (f": {c.message}" if c.message else ""))
    tensors = []
    for name in sorted(set(b.errors) | set(c.errors)):
        then, now = b.errors.get(name), c.errors.get(name)
        grew = _grew(then, now, t)
        tensors.append({"tensor": name, "then": then, "now": now, "regressed": grew})
        if grew:
            regressions.append(f"{name} max|diff| {fmt(then)} -> {fmt(now)} (more than x{t.error_factor:g})")
    # A job refused before its case was complete has gaps the matched job's case fills.
    case = {**c.case, **{k: v for k, v in b.case.items() if c.case.get(k) is None}}
    entry = {"case": case, "baseline": b.label, "candidate": c.label, "verdict_then": b.verdict,
             "verdict_now": c.verdict, "tensors": tensors, "bench_median_s_then": b.bench_median_s,
             "bench_median_s_now": c.bench_median_s}
    if b.bench_median_s and c.bench_median_s is not None and c.bench_median_s > b.bench_median_s * (1 + t.slower):
        regressions.append(f"bench median {fmt(b.bench_median_s * 1e3)} ms -> {fmt(c.bench_median_s * 1e3)} ms "
                           f"(more than {t.slower:.0%} slower)")
    entry["regressions"] = regressions
    return entry


def compare(baseline: list[Job], candidate: list[Job], t: Thresholds) -> dict:
    """The whole comparison, JSON-ready; `regressed` decides the exit status."""
    pairs, only_baseline, only_candidate = match(baseline, candidate)
    matched = [compare_pair(b, c, t) for b, c in pairs]
    unmatched_failing = [c for c in only_candidate if c.verdict in NOT_PASSED]
    missing_passed = [b for b in only_baseline if b.verdict == "PASS"]
    return {
        "thresholds": dataclasses.asdict(t),
        "matched": matched,
        "only_baseline": [_unmatched(j) for j in only_baseline],
        "only_candidate": [_unmatched(j) for j in only_candidate],
        "unmatched_candidate_not_passed": [j.label for j in unmatched_failing],
        "baseline_passed_missing": [j.label for j in missing_passed],
        "regressed": any(m["regressions"] for m in matched) or bool(unmatched_failing) or bool(missing_passed),
    }


def _unmatched(j: Job) -> dict:
    return {"job": j.label, "case": j.case, "verdict": j.verdict, "message": j.message}


def _case_text(case: dict) -> str:
    if not case:
        return "-"
    size = f"ep={case['ep']}" if case.get("ep") is not None else f"tp={case.get('tp')} local_t={case.get('local_t')}"
    dp = f" dp={case['dp']}" if (case.get("dp") or 1) > 1 else ""
    starts = "" if case.get("start_pos") is None else f" start_pos={case['start_pos']}"
    scope = "" if case.get("scope") in (None, "full") else f" scope={case['scope']}"
    return f"{case.get('layer')}{scope} {case.get('model')} {size}{dp}{starts} seed={seed_text(case.get('seed'))}"


def render(report: dict) -> str:
    """The comparison as a table: one line per compared tensor of each matched job, then the
    regressions and the unmatched jobs."""
    cells = [["baseline", "candidate", "case", "verdict", "tensor", "max|diff| then", "now", "bench_ms then", "now"]]
    for m in report["matched"]:
        verdicts = m["verdict_then"] if m["verdict_then"] == m["verdict_now"] else f"{m['verdict_then']}->{m['verdict_now']}"
        bench = [_ms(m["bench_median_s_then"]), _ms(m["bench_median_s_now"])]
        tensors = m["tensors"] or [{"tensor": "-", "then": None, "now": None, "regressed": False}]
        for i, t in enumerate(tensors):
            mark = " !" if t["regressed"] else ""
            head = [m["baseline"], m["candidate"], _case_text(m["case"]), verdicts] if i == 0 else ["", "", "", ""]
            cells.append(head + [t["tensor"], fmt(t["then"]), fmt(t["now"]) + mark] + (bench if i == 0 else ["", ""]))
    lines = table_lines(cells)
    for m in report["matched"]:
        for r in m["regressions"]:
            lines.append(f"REGRESSION {m['candidate']} ({_case_text(m['case'])}): {r}")
    for name in report["unmatched_candidate_not_passed"]:
        j = next(u for u in report["only_candidate"] if u["job"] == name)
        lines.append(f"REGRESSION {name} ({_case_text(j['case'])}): {j['verdict']} with no baseline job of its case"
                     + (f": {j['message']}" if j["message"] else ""))
    for name in report["baseline_passed_missing"]:
        j = next(u for u in report["only_baseline"] if u["job"] == name)
        lines.append(f"REGRESSION {name} ({_case_text(j['case'])}): PASS in the baseline, no candidate job of its case")
    for side in ("only_baseline", "only_candidate"):
        for j in report[side]:
            lines.append(f"unmatched, {side.replace('_', ' ')}: {j['job']} ({_case_text(j['case'])}) {j['verdict']}")
    n_reg = (sum(bool(m["regressions"]) for m in report["matched"]) + len(report["unmatched_candidate_not_passed"])
             + len(report["baseline_passed_missing"]))
    lines.append(f"compare: {len(report['matched'])} matched, {n_reg} regressed, {len(report['only_baseline'])} only in "
                 f"the baseline, {len(report['only_candidate'])} only in the candidate")
    return "\n".join(lines)


def _ms(seconds: Any) -> str:
    return fmt(seconds * 1e3) if seconds is not None else "-"
