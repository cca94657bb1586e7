"""result.json, read and written: the verdict word of a result, its exit status, and the one writer.

A result is built once, by the side that launched the run (`launcher.run.run_result.RunResult`:
`status`, `passed`, the case, per-tensor verdicts with pooled and per-rank figures, per-rank
phase times, and on error the root-cause rank, phase, message, traceback and log folder);
what is here reads its JSON. Rendering (`launcher.report.console`) and the sweep's summary
(`launcher.report.sweep_summary`) never need anything but that dict.

A run that never reached the ranks still leaves a result, so that every job of a sweep has
one: status "config-error" (refused by the preflight), "skipped" (a sweep with fail_fast after
a failed job) or "error" with phase "launcher" (the launcher process itself raised).

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
import datetime
import json
import os
import platform
import sys

from launcher.report.exit_codes import EXIT_ERROR, EXIT_FAIL, EXIT_PASS
from launcher.report.verdict import check_name, counts_nothing, decision, integrity_failures, reference_verdict



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
# 2: an error entry names the rank phase it failed in as `phase` (1: `stage`).
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)  # what the readers (compare, a sweep's summary) take


def failed_phase(error: dict) -> str | None:
    """The phase an error entry says the run failed in (a rank phase, or "config", "launcher",
    "rendezvous", "interrupted"): `phase`, or `stage` in a result of schema_version 1."""
    return error.get("phase", error.get("stage"))


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
