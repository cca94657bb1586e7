"""A run's result, built once: `RunResult`, the body of result.json (`to_json`).

Built by the side that launched the run: from what this node's comparing rank returned
(`RunResult.launched`), or for a run that never reached the ranks (`RunResult.not_launched`:
status "config-error", "skipped" or "error"; `RunResult.launcher_error`: the launcher process
itself raised). `passed` is decided here once, by `launcher.config.verdict_words.run_passes`,
the rule the ranks broadcast their verdict by too. The writer (`launcher.report.result.write_result`)
adds the provenance, the verdict word and the decision; the readers (console, pages, the
sweep's summary, compare, rerun, the pytest plugin) read the JSON.

A field left at `ABSENT` is not written: result.json's keys are what they were before the
result had a type (schema_version 1), but for the error entry's `phase` (its `stage` there).
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import TYPE_CHECKING, Any

from launcher.config.verdict_words import run_passes

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()  # a key this result does not have

# Each rank's figures (a list by rank) and the golden cache's hits and problems, as rank 0 returns them.
RANK_FIGURES = ("rank_seconds", "rank_cpu_seconds", "golden_cache_hits", "input_cache_hits", "golden_cache_problems",
                "rank_peak_rss_mib", "rank_cpus")


@dataclasses.dataclass
class RunResult:
    """One run's result: `status` ("ok", "error", "config-error", "skipped"), `passed`, the
    case, per-tensor verdicts with pooled and per-rank figures, per-rank phase times, and on
    error the root-cause rank, phase, message, traceback and log folder."""

    case: dict
    status: str
    passed: bool
    wall_s: float
    # What the run ran on (a launched run).
    model_fields: dict = ABSENT
    backend: str = ABSENT
    devices: list = ABSENT
    threads_per_rank: int = ABSENT
    job_slot: dict | None = ABSENT
    log_dir: str | None = ABSENT
    snapshot: dict = ABSENT
    tolerance: dict = ABSENT
    error: dict = ABSENT
    # A run that reached its end on this node.
    node_rank: int = ABSENT
    unchecked: bool = ABSENT  # nothing was compared (golden=false, or rank 0's verdict was None)
    compared_on_node: int = ABSENT  # a node without rank 0: it took rank 0's verdict
    # RANK_FIGURES, as rank 0 collected them: written at result.json's top level.
    rank_figures: dict = ABSENT
    golden_data: str | None = ABSENT
    save_data: str | None = ABSENT
    rank_processes: int | None = ABSENT
    bench: dict = ABSENT
    # The verdicts: the first group that did not pass (group 0 when all did), each group's in `groups`.
    reference: str | None = ABSENT
    verdicts: list = ABSENT
    reference_passed: bool = ABSENT
    integrity: dict = ABSENT
    recomputed_verdicts: list = ABSENT
    bisect: dict = ABSENT
    groups: list = ABSENT
    plots: list = ABSENT

    def to_json(self) -> dict:
        """result.json's body: every field this result has."""
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not ABSENT}
        figures = body.pop("rank_figures", {})
        return {**body, **figures}

    @classmethod
    def launched(cls, spec: RunSpec, *, machine: dict, rank_result: dict | None, error: dict | None, log_dir: str,
                 wall_s: float) -> RunResult:
        """The result of a launched run. `machine`: the backend and devices the ranks ran on
        (`launcher.run.devices.machine_entry`); `rank_result`: what this node's comparing rank
        returned (`launcher.run.worker.rank_main`; None when a rank failed); `error`: the
        root-cause rank's failure (`launcher.run.launch.RankFailure`, as a dict) or None."""
        result = cls(
            case=spec.case_entry(), status="ok", passed=False, wall_s=round(wall_s, 3),
            model_fields=spec.case.model.fields(), backend=machine["backend"], devices=machine["devices"],
            threads_per_rank=spec.threads(),
            job_slot=dataclasses.asdict(spec.slot) if spec.slot is not None else None, log_dir=log_dir,
            tolerance=spec.tolerances.entry(spec.layer.checks(spec.case)),
        )
        if spec.snapshot:
            result.snapshot = spec.snapshot
        if error is not None:
            result.status, result.error = "error", error
            return result
        r = rank_result
        result.node_rank = spec.node_rank
        if not r["reporting"]:  # a node without rank 0: the verdict rank 0 broadcast
            result.passed, result.verdicts, result.compared_on_node = bool(r["passed"]), [], 0
            if r["passed"] is None:
                result.unchecked = True
            return result
        result.rank_figures = {key: r[key] for key in RANK_FIGURES}
        result.golden_data, result.save_data = spec.golden_data, spec.save_data
        result.rank_processes = r.get("rank_processes")  # how many jobs this job's rank processes have run
        if r.get("bench") is not None:
            result.bench = r["bench"]
        groups = [_group_entry(g) for g in r["groups"]]
        if groups[0]["verdicts"] is None:  # golden=false: a performance-only run, nothing compared
            result.unchecked, result.reference, result.verdicts = True, None, []
            return result
        shown = next((g for g in groups if not g["passed"]), groups[0])
        integrity = {**shown["integrity"], "passed": None if not shown["integrity"]["enabled"]
                     else all(g["integrity"]["passed"] for g in groups)}
        # The one verdict: UNCHECKED (no check counts) never reads as passed.
        result.passed = bool(run_passes([v for g in r["groups"] for vs in g["comparisons"].values() for v in vs],
                                        _integrity_checks(r["groups"])))
        result.reference, result.verdicts, result.integrity = shown["reference"], shown["verdicts"], integrity
        result.reference_passed = all(g["reference_passed"] for g in groups)
        for key in ("recomputed_verdicts", "bisect"):
            if key in shown:
                setattr(result, key, shown[key])
        if spec.dp > 1:
            result.groups = groups
        return result

    @classmethod
    def not_launched(cls, case: dict, status: str, message: str, *, wall_s: float, phase: str | None = None,
                     trace: str = "") -> RunResult:
        """The result of a run that started no rank (status config-error, skipped or error)."""
        return cls(case=case, status=status, passed=False, wall_s=round(wall_s, 3),
                   error={"rank": None, "phase": phase, "message": message, "traceback": trace, "exitcode": None,
                          "log_dir": None, "other_ranks": []})

    @classmethod
    def launcher_error(cls, case: dict, exc: BaseException, *, wall_s: float) -> RunResult:
        """The result of a run whose launcher process raised (a bug or a broken environment)."""
        trace = "".join(traceback.format_exception(exc))
        return cls.not_launched(case, "error", f"{type(exc).__name__}: {exc}", wall_s=wall_s, phase="launcher",
                                trace=trace)


def _integrity_checks(groups: list[dict]) -> list[dict]:
    """Every integrity check of every group, against every reference."""
    return [c for g in groups if g["integrity"] is not None for cs in g["integrity"].values() for c in cs]


def _group_entry(group: dict) -> dict:
    """One TP group's verdicts: against the snapshot when one is replayed, else the computed
    golden (the recomputed golden beside a snapshot as `recomputed_verdicts`), and the
    integrity checks beside them."""
    entry = {"group": group["group"], "ranks": group["ranks"], "seed": group["seed"]}
    comparisons = group["comparisons"]
    if comparisons is None:
        return {**entry, "passed": None, "reference": None, "verdicts": None}
    primary = "snapshot" if "snapshot" in comparisons else "golden"
    verdicts = [v for vs in comparisons.values() for v in vs]
    integrity = _integrity_entry(group["integrity"], primary)
    entry.update(reference=primary, verdicts=comparisons[primary],
                 reference_passed=run_passes(verdicts, []) is not False, integrity=integrity,
                 passed=bool(run_passes(verdicts, _integrity_checks([group]))))
    if primary == "snapshot" and "golden" in comparisons:
        entry["recomputed_verdicts"] = comparisons["golden"]
    if group.get("bisect") is not None:
        entry["bisect"] = group["bisect"]
    return entry


def _integrity_entry(integrity: dict | None, primary: str) -> dict:
    """result.json's `integrity`: the checks against the primary reference, and against the
    golden recomputed beside a replayed snapshot."""
    if integrity is None:
        return {"enabled": False, "passed": None, "checks": []}
    entry = {"enabled": True, "passed": all(c["passed"] for cs in integrity.values() for c in cs),
             "checks": integrity[primary]}
    if primary == "snapshot" and "golden" in integrity:
        entry["recomputed_checks"] = integrity["golden"]
    return entry
