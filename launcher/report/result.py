"""The run's result: the JSON-ready dict every run leaves as `result.json`, and its exit status.

A result is `status` ("ok" or "error"), `passed`, the case, per-tensor verdicts with pooled
and per-rank figures, per-rank stage times, and on error the root-cause rank, stage, message,
traceback and log folder. Rendering (`launcher.report.console`) and the sweep's summary
(`launcher.report.sweep_summary`) never need anything but that dict.

A run that never reached the ranks still leaves a result, so that every job of a sweep has
one: status "config-error" (refused by the preflight), "skipped" (a sweep with fail_fast after
a failed job) or "error" with stage "launcher" (the launcher process itself raised).

Where the errors are: a failing verdict may carry `where`, the grids of `launcher.verify.where`
(bad points per rank x token block / hc copy / physical block); every verdict carries `tally`,
the figures its summary row shows (`launcher.verify.where.tally`).

Two verdicts decide `passed`: the reference comparators' (`reference_passed`, every entry of
`verdicts`) and the integrity checks beside them (`integrity`, `launcher.verify.integrity`:
`{"enabled", "passed", "checks": [...], "recomputed_checks": [...]}`; with integrity=false
enabled is false, passed None and the reference verdict alone decides).

result.json also carries `verdict` and `decision` (`launcher.report.verdict`): which check
decided, the two verdicts side by side, what was loosened. A run where no check counts (every
reference check diagnostic, no integrity check) is UNCHECKED and not `passed`.

`write_result` is the one writer of result.json (`python -m launcher` and `launcher.torchrun`,
through `launcher.report.run_page.write_result_and_page`, which adds the run's report.html),
`exit_code` the one rule from a result to the process's exit status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys
import traceback
from typing import TYPE_CHECKING

from launcher.config.verdict_words import fails_the_run
from launcher.report.exit_codes import EXIT_ERROR, EXIT_FAIL, EXIT_PASS
from launcher.report.verdict import check_name, counts_nothing, decision, integrity_failures, reference_verdict

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec



def verdict(result: dict) -> str:
    """PASS / FAIL; UNCHECKED for a performance-only run (golden=false: nothing was compared)
    and for a run where no check counts (every reference check diagnostic, no integrity check);
    ERROR for a run that failed or was refused; SKIP for a fail_fast skip."""
    if result["status"] == "skipped":
        return "SKIP"
    if result["status"] != "ok":
        return "ERROR"
    if result.get("unchecked") or counts_nothing(result):
        return "UNCHECKED"
    return "PASS" if result["passed"] else "FAIL"


def exit_code(result: dict) -> int:
    """0 PASS (and UNCHECKED: a performance-only run that ran), 1 FAIL, 2 anything else."""
    return {"PASS": EXIT_PASS, "UNCHECKED": EXIT_PASS, "FAIL": EXIT_FAIL}.get(verdict(result), EXIT_ERROR)


# The layout of result.json and summary.json: raised when a key changes meaning or goes away.
SCHEMA_VERSION = 1


def provenance() -> dict:
    """What produced a record, for reading it later: the layout's version, when (UTC), the
    tool's and torch's versions (torch_npu's and CUDA's where present) and the host."""
    # Imported here: reading a result (`launcher.compare`) must not pay for torch; writing one
    # runs where torch is loaded already.
    import torch

    from launcher.store import snapshot

    record = {"schema_version": SCHEMA_VERSION,
              "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "tool_version": snapshot.tool_version(), "torch": torch.__version__}
    if torch.version.cuda:
        record["cuda"] = torch.version.cuda
    npu = sys.modules.get("torch_npu")  # imported only by an hccl run: never imported here
    if npu is not None:
        record["torch_npu"] = getattr(npu, "__version__", "unknown")
    record["host"] = platform.node()
    return record


def write_result(output_dir: str, result: dict, job: dict | None = None) -> dict:
    """result.json, written whole or not at all, with its provenance; a sweep's job carries
    its `job` entry (`launcher.report.sweep_summary.job_entry`). Returns the dict written (with its
    provenance, verdict and job)."""
    os.makedirs(output_dir, exist_ok=True)
    word = verdict(result)
    result = {**provenance(), **result, "verdict": word, "decision": decision(result, word)}
    if job is not None:
        result["job"] = job
    path = os.path.join(output_dir, "result.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)
    except OSError:  # a full disk: no half-written temp file stays behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return result


def build_result(spec: RunSpec, *, machine: dict, rank_result: dict | None, error: dict | None, log_dir: str,
                 wall_s: float) -> dict:
    """The result of a launched run. `machine`: the backend and devices the ranks ran on
    (`launcher.run.devices.machine_entry`, worked out by the launching side); `rank_result`: what
    this node's comparing rank returned (`launcher.run.worker.rank_main`; None when a rank
    failed); `error`: the root-cause rank's failure (`launcher.run.launch.RankFailure`, as a
    dict) or None."""
    result = {
        "case": spec.case_entry(),
        "model_fields": spec.case.model.fields(),
        "backend": machine["backend"],
        "devices": machine["devices"],
        "threads_per_rank": spec.threads(),
        "job_slot": dataclasses.asdict(spec.slot) if spec.slot is not None else None,
        "wall_s": round(wall_s, 3),
        "log_dir": log_dir,
    }
    if spec.snapshot:
        result["snapshot"] = spec.snapshot
    result["tolerance"] = spec.tolerances.entry(spec.layer.checks(spec.case))
    if error is not None:
        result.update(status="error", passed=False, error=error)
        return result
    r = rank_result
    result["node_rank"] = spec.node_rank
    if not r["reporting"]:  # a node without rank 0: the verdict rank 0 broadcast
        result.update(status="ok", passed=bool(r["passed"]), verdicts=[], compared_on_node=0)
        if r["passed"] is None:
            result.update(passed=False, unchecked=True)
        return result
    result.update(
        status="ok", rank_seconds=r["rank_seconds"], rank_cpu_seconds=r["rank_cpu_seconds"],
        golden_cache_hits=r["golden_cache_hits"], input_cache_hits=r["input_cache_hits"],
        golden_cache_problems=r["golden_cache_problems"], rank_peak_rss_mib=r["rank_peak_rss_mib"],
        rank_cpus=r["rank_cpus"], golden_data=spec.golden_data, save_data=spec.save_data,
        rank_processes=r.get("rank_processes"),  # how many jobs this job's rank processes have run
    )
    if r.get("bench") is not None:
        result["bench"] = r["bench"]
    groups = [_group_entry(g) for g in r["groups"]]
    if groups[0]["verdicts"] is None:  # golden=false: a performance-only run, nothing compared
        result.update(passed=False, unchecked=True, reference=None, verdicts=[])
        return result
    # The top level is the first group that did not pass (group 0 when all did); with several
    # TP groups, `groups` holds each group's own verdicts.
    shown = next((g for g in groups if not g["passed"]), groups[0])
    integrity = {**shown["integrity"], "passed": None if not shown["integrity"]["enabled"]
                 else all(g["integrity"]["passed"] for g in groups)}
    result.update(passed=all(g["passed"] for g in groups), reference=shown["reference"], verdicts=shown["verdicts"],
                  reference_passed=all(g["reference_passed"] for g in groups), integrity=integrity)
    for key in ("recomputed_verdicts", "bisect"):
        if key in shown:
            result[key] = shown[key]
    if spec.dp > 1:
        result["groups"] = groups
    if counts_nothing(result):  # UNCHECKED: a run no check could fail never reads as passed
        result["passed"] = False
    return result


def _group_entry(group: dict) -> dict:
    """One TP group's verdicts: against the snapshot when one is replayed, else the computed
    golden (the recomputed golden beside a snapshot as `recomputed_verdicts`), and the
    integrity checks beside them."""
    entry = {"group": group["group"], "ranks": group["ranks"], "seed": group["seed"]}
    comparisons = group["comparisons"]
    if comparisons is None:
        return {**entry, "passed": None, "reference": None, "verdicts": None}
    primary = "snapshot" if "snapshot" in comparisons else "golden"
    verdicts = comparisons[primary]
    integrity = _integrity_entry(group["integrity"], primary)
    reference_passed = not any(fails_the_run(v) for vs in comparisons.values() for v in vs)
    entry.update(reference=primary, verdicts=verdicts, reference_passed=reference_passed, integrity=integrity,
                 passed=reference_passed and integrity["passed"] is not False)
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


def integrity_verdict(result: dict) -> str:
    """`integrity: off`, `integrity: PASS` or `integrity: FAIL (kv_cache written_rows: 2 unwritten row(s) ...)`."""
    if not result["integrity"]["enabled"]:
        return "integrity: off"
    failures = integrity_failures(result)
    if not failures:
        return "integrity: PASS"
    return "integrity: FAIL (" + "; ".join(f"{check_name(c)}: {c['summary']}" for c in failures) + ")"


def verdict_pair(result: dict) -> str:
    """The reference verdict beside the integrity one: `reference verdict: PASS, integrity: FAIL (...)`."""
    word = reference_verdict(result)
    shown = "off (every reference check is diagnostic: none fails the run)" if word == "off" else word
    return f"reference verdict: {shown}, {integrity_verdict(result)}"


# -- results of runs that never reached the ranks ----------------------------------------------


def not_launched(case: dict, status: str, message: str, *, wall_s: float, stage: str | None = None,
                 trace: str = "") -> dict:
    """The result of a run that started no rank (status config-error, skipped or error)."""
    return {
        "case": case,
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
