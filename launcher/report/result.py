"""The run's result: the JSON-ready dict every run leaves as `result.json`, and its exit status.

A result is `status` ("ok" or "error"), `passed`, the case, per-tensor verdicts with pooled
and per-rank figures, per-rank stage times, and on error the root-cause rank, stage, message,
traceback and log folder. Rendering (`launcher.report.console`) and the sweep's summary
(`launcher.report.sweep`) never need anything but that dict.

A run that never reached the ranks still leaves a result, so that every job of a sweep has
one: status "config-error" (refused by the preflight), "skipped" (a sweep with fail_fast after
a failed job) or "error" with stage "launcher" (the launcher process itself raised).

Where the errors are: a failing verdict may carry `where`, the grids of `launcher.verify.where`
(bad points per rank x token block / hc copy / physical block).

`write_result` is the one writer of result.json (`python -m launcher` and `launcher.torchrun`),
`exit_code` the one rule from a result to the process's exit status.
"""

from __future__ import annotations

import json
import os
import platform
import traceback

import torch

from launcher.config.spec import RunSpec

# The exit status of a run: every compared tensor passed, a mismatch, anything else (an
# invalid config, a crashed or hung rank, an implementation that broke the contract).
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2


def exit_code(result: dict) -> int:
    """0 PASS, 1 FAIL; 2 for a result that is not a verdict (error, config-error, skipped)."""
    if result["status"] != "ok":
        return EXIT_ERROR
    return EXIT_PASS if result["passed"] else EXIT_FAIL


def write_result(output_dir: str, result: dict, job: dict | None = None) -> None:
    """result.json, written whole or not at all; a sweep's job carries its `job` entry
    (`launcher.report.sweep.job_entry`)."""
    os.makedirs(output_dir, exist_ok=True)
    if job is not None:
        result = {**result, "job": job}
    path = os.path.join(output_dir, "result.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def build_result(spec: RunSpec, *, rank_result: dict | None, error: dict | None, log_dir: str,
                 wall_s: float) -> dict:
    """The result of a launched run. `rank_result`: what this node's comparing rank returned
    (`launcher.run.worker.rank_main`; None when a rank failed); `error`: the root-cause rank's
    failure (`launcher.run.launch.RankFailure`, as a dict) or None."""
    result = {
        "case": spec.case_entry(),
        "model_fields": spec.case.model.fields(),
        "torch": torch.__version__,
        "host": platform.node(),
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


# -- results of runs that never reached the ranks ----------------------------------------------


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
