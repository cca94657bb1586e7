"""Sweeps: the Hydra callback that reports a multirun.

`SweepSummary` (registered under `hydra.callbacks` in configs/config.yaml) prints a line as
each job starts and ends, and at the end of the multirun writes, into the sweep directory:

* `summary.json`: `{"schema_version", "created_utc", "tool_version", "torch", ..., "sweep_dir", "n_jobs",
  "passed", "failed", "errors", "skipped", "jobs": [...]}` (the provenance of `launcher.report.result`),
  one entry per job (its overrides, case, verdict, the reference verdict and the integrity
  verdict beside it, worst tensor and the figures of its row, message, wall time);
* `junit.xml`: one testsuite, one testcase per job, named by its case (never its job number, so
  that CI history follows a case through a reordered sweep); a FAIL carries the comparators' and
  the failing integrity checks' messages as `<failure>`, a crashed or refused job an `<error>`, a
  fail_fast skip and an UNCHECKED job (nothing judged) `<skipped>`; every compared job's VERDICT
  line (`launcher.report.verdict.line`) and each loosened check as properties;
* `report.html`: the same jobs as a page, each linking to its own (`launcher.report.sweep_page`);

and prints the same rows as a table on stdout. Every row comes from the job's result.json
(`launcher.job.execute` writes one for every outcome), so a crashed job has its row too.
Jobs run one after another in this process (the harness's launcher,
`hydra_plugins.dsv4_tp_harness.harness_sweeper`): each on new rank processes or on the warm ones of an
earlier job (`launcher.run.rank_group`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from layers.contract.case import GROUP_KEYS, LIST_KEYS, SCALAR_KEYS
from layers.contract.config import ConfigError

from launcher.config.slurm import node_output_dir
from launcher.config.sweep_jobs import planned_jobs
from launcher.config.verdict_words import fails_the_run
from launcher.report import progress
from launcher.report.console import (
    case_columns, comparator_text, fmt, seed_text, starts_text, table_lines, varied_columns, varying_keys,
)
from launcher.report.result import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_PASS,
    check_name,
    failed_phase,
    integrity_failures,
    integrity_verdict,
    provenance,
    verdict,
    verdict_pair,
)
from launcher.report.sweep_page import write_sweep_page
from launcher.report.verdict import account, decision, line as verdict_line
from launcher.store import cache_dir

SUMMARY_COUNTS = {"passed": "PASS", "failed": "FAIL", "errors": "ERROR", "skipped": "SKIP", "unchecked": "UNCHECKED"}
# The exit status a job's verdict stands for; a fail_fast skip follows a job that did not pass,
# which already decides the sweep's status.
EXIT_CODES = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL, "ERROR": EXIT_ERROR, "SKIP": EXIT_PASS, "UNCHECKED": EXIT_PASS}


# -- one row per job ---------------------------------------------------------------------------


def _worst(verdicts: list[dict], failed: set[str]) -> dict | None:
    """The verdict to name in a summary: one of a failed tensor (reference or integrity) first,
    then the largest max |diff|, then the latest in validation order (x_out, the layer's
    output, comes last)."""
    def key(v):
        return (v["tensor"] in failed, v["tally"]["max_abs_diff"] or 0.0)

    return max(reversed(verdicts), key=key, default=None)


def job_row(num: int, overrides: list[str], output_dir: str, result: dict | None) -> dict:
    """A job's summary entry from its result.json (None when the job left none)."""
    row: dict[str, Any] = {"job": num, "overrides": overrides, "output_dir": output_dir}
    if result is None:
        row.update(status="error", verdict="ERROR", exit_code=EXIT_CODES["ERROR"], passed=False, wall_s=None,
                   failed_tensors=[], tensor=None,
                   message="the job wrote no result.json (it was killed, lost or never started)")
        return row
    case = result["case"]
    row.update({k: case.get(k) for k in ("layer", "phase", "cp", "cp_layout", "prefix", "segment_lens", "scope", "model", *GROUP_KEYS, *SCALAR_KEYS, *LIST_KEYS, "seed",
                                         "impl")})
    row["dp"] = case.get("dp", 1)
    row.update(status=result["status"], passed=bool(result["passed"]), wall_s=result.get("wall_s"))
    verdicts = result.get("verdicts", []) + result.get("recomputed_verdicts", [])
    failed = [v for v in verdicts if fails_the_run(v)]
    broken = integrity_failures(result)
    row["failed_tensors"] = sorted({v["tensor"] for v in failed} | {c["tensor"] for c in broken})
    # Every check's effective comparator; `overridden`: what the tolerance config set.
    row["checks"] = [{"tensor": v["tensor"], "comparator": v["label"], "passed": v["passed"],
                      "diagnostic": bool(v.get("diagnostic")), "overridden": v.get("overridden") or {}}
                     for v in result.get("verdicts", [])]
    row["tolerance_profile"] = (result.get("tolerance") or {}).get("profile")
    worst = _worst(verdicts, set(row["failed_tensors"]))
    tally = worst["tally"] if worst else {}
    row.update(
        tensor=worst["tensor"] if worst else None,
        comparator=worst["label"] if worst else None,
        max_abs_diff=tally.get("max_abs_diff"),
        worst=tally.get("worst"),
        n_bad=tally.get("n_bad"),
        numel=tally.get("numel"),
    )
    if "integrity" in result:  # a run that compared
        row["reference_verdict"] = "PASS" if result["reference_passed"] else "FAIL"
        row["integrity"] = ("PASS" if result["integrity"]["passed"] else "FAIL") if result["integrity"]["enabled"] else "off"
        row["integrity_failed"] = [check_name(c) for c in broken]
    row["verdict"] = verdict(result)
    row["exit_code"] = EXIT_CODES[row["verdict"]]
    row["decision"] = decision(result, row["verdict"])
    row["loosened"] = row["decision"].get("loosened", [])
    if result.get("bench"):
        row["bench_median_s"] = result["bench"]["median_s"]
    if result["status"] != "ok":
        e = result["error"]
        # Named once: a message that already says which rank or phase is kept as it is.
        where = f"rank {e['rank']} " if e.get("rank") is not None and f"rank {e['rank']}" not in e["message"] else ""
        phase = failed_phase(e)
        phase = f"in phase '{phase}': " if phase and phase not in e["message"] else ""
        row["message"] = f"{where}{phase}{e['message']}"
        row["traceback"] = e.get("traceback", "")
    else:
        messages = [f"{v['tensor']} FAIL ({comparator_text(v)})" for v in failed]
        if broken:  # the integrity verdict beside the reference one, when it decides
            messages.append(integrity_verdict(result) if failed else verdict_pair(result))
        if row["verdict"] == "UNCHECKED" or row["loosened"]:  # the verdict line's own words
            messages.append(account(row["decision"]))
        row["message"] = "; ".join(messages)
        row["details"] = [f"{v['tensor']} FAIL ({comparator_text(v)})\n{v['detail']}" for v in failed]
        row["details"] += [f"{check_name(c)} integrity FAIL\n{c['detail']}" for c in broken]
    return row


def table(rows: list[dict]) -> list[str]:
    """The summary table: one line per job, then one line per job that did not pass."""
    keys = case_columns(rows) + varied_columns(rows)
    head = ["job", "layer", "scope", "model", *keys, "verdict", "integrity", "tensor", "max|diff|", "bad", "wall_s"]
    benched = any(r.get("bench_median_s") is not None for r in rows)
    cells = [head + ["bench_ms"] if benched else head]
    for r in rows:
        bad = f"{r['n_bad']}/{r['numel']}" if r.get("n_bad") is not None else "-"
        case = [starts_text(r.get(k)) if k == "start_pos" else fmt(r.get(k)) for k in keys]
        cells.append([str(r["job"]), fmt(r.get("layer")), fmt(r.get("scope")), fmt(r.get("model")), *case,
                      r["verdict"], fmt(r.get("integrity")), fmt(r.get("tensor")), fmt(r.get("max_abs_diff")), bad, fmt(r.get("wall_s"))])
        if benched:
            median = r.get("bench_median_s")
            cells[-1].append(fmt(median * 1e3) if median is not None else "-")
    lines = table_lines(cells)
    for r in rows:
        if r["verdict"] != "PASS" or r.get("loosened"):
            lines.append(f"job {r['job']} {r['verdict']}: {r['message']}  ({r['output_dir']})")
    return lines


# -- JUnit XML ---------------------------------------------------------------------------------

# XML 1.0 allows tab, newline, carriage return and printable characters only.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _xml_text(s: str) -> str:
    return _NOT_XML.sub("?", s)


# The case's own fields, named first and in this order; the other overrides follow, sorted.
_CASE_KEYS = ("model", *GROUP_KEYS, "dp", *SCALAR_KEYS, *LIST_KEYS, "seed")


def case_name(row: dict) -> str:
    """A job's test name: its case (model, tp or ep, dp above 1, local_t or the MoE keys, start
    positions unless canonical, seed) and the rest of its overrides, sorted; independent of the
    job's place in the sweep."""
    # A null seed in the case of a job that ran: it ran on a snapshot's inputs alone (`seed=-`);
    # in a refused job's, a seed that could not be read (its override says what was given).
    seedless = "seed" in row and row.get("status") != "config-error"
    shown = [k for k in _CASE_KEYS if row.get(k) is not None or k == "seed" and seedless]
    fields = [f"{k}={starts_text(row[k]) if k == 'start_pos' else seed_text(row[k]) if k == 'seed' else row[k]}"
              for k in shown if not (k == "dp" and row[k] == 1)]
    named = {k for k in ("layer", "scope") if row.get(k) is not None} | set(shown)  # shown by the classname or above
    rest = sorted(o for o in row["overrides"] if not o.startswith("hydra.") and o.split("=", 1)[0].lstrip("+~") not in named)
    return " ".join(fields + rest) or "default"


def junit_tree(rows: list[dict], suite: str = "dsv4-tp-harness") -> ET.ElementTree:
    counts = {k: sum(r["verdict"] == k for r in rows) for k in ("FAIL", "ERROR", "SKIP", "UNCHECKED")}
    total_s = sum(r.get("wall_s") or 0.0 for r in rows)
    attrs = {"name": suite, "tests": str(len(rows)), "failures": str(counts["FAIL"]), "errors": str(counts["ERROR"]),
             "skipped": str(counts["SKIP"] + counts["UNCHECKED"]), "time": f"{total_s:.3f}"}
    root = ET.Element("testsuites", attrs)
    ts = ET.SubElement(root, "testsuite", attrs)
    seen: dict[str, int] = {}
    for r in rows:
        name = case_name(r)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # the same case twice in one sweep: still one testcase each
            name = f"{name} ({seen[name]})"
        tc = ET.SubElement(ts, "testcase", {
            "classname": f"{suite}.{r.get('layer') or 'unknown'}.{r.get('scope') or 'full'}", "name": _xml_text(name),
            "time": f"{r.get('wall_s') or 0.0:.3f}",
        })
        _check_properties(tc, r)
        if r["verdict"] == "FAIL":
            el = ET.SubElement(tc, "failure", {"message": _xml_text(r["message"]), "type": "FAIL"})
            el.text = _xml_text("\n\n".join(r.get("details", [])))
        elif r["verdict"] == "ERROR":
            el = ET.SubElement(tc, "error", {"message": _xml_text(r["message"]), "type": r["status"]})
            el.text = _xml_text(r.get("traceback") or r["message"])
        elif r["verdict"] == "SKIP":
            ET.SubElement(tc, "skipped", {"message": _xml_text(r["message"])})
        elif r["verdict"] == "UNCHECKED":  # nothing was judged: never a passed testcase
            d = r.get("decision") or {"verdict": "UNCHECKED"}
            why = verdict_line(d) if "reference" in d else "UNCHECKED: golden=false, a performance run: nothing was compared"
            ET.SubElement(tc, "skipped", {"message": _xml_text(why)})
        if r.get("bench_median_s") is not None:
            props = ET.SubElement(tc, "properties")
            ET.SubElement(props, "property", {"name": "bench_median_s", "value": repr(r["bench_median_s"])})
        out = ET.SubElement(tc, "system-out")
        out.text = f"output_dir: {r['output_dir']}"
    ET.indent(root)
    return ET.ElementTree(root)


def _check_properties(testcase: ET.Element, row: dict) -> None:
    """The effective comparator of every check (its tolerance-set parameters marked) and the
    tolerance profile, as testcase properties."""
    if not row.get("checks"):
        return
    props = ET.SubElement(testcase, "properties")
    if row.get("decision"):  # the VERDICT line: which check decided, what was loosened
        ET.SubElement(props, "property", {"name": "verdict", "value": _xml_text(verdict_line(row["decision"]))})
    for item in row.get("loosened") or []:
        ET.SubElement(props, "property", {"name": "loosened", "value": _xml_text(item)})
    ET.SubElement(props, "property", {"name": "tolerance_profile", "value": str(row.get("tolerance_profile"))})
    for c in row["checks"]:
        value = comparator_text({"label": c["comparator"], "overridden": c["overridden"]})
        verdict = ("PASS" if c["passed"] else "FAIL") + (" (diagnostic)" if c["diagnostic"] else "")
        ET.SubElement(props, "property", {"name": f"check.{c['tensor']}", "value": _xml_text(f"{verdict} {value}")})


# -- the sweep's own record: which jobs it planned, which results belong to it ----------------

SWEEP_FILE = "sweep.json"


def start_record(sweep_dir: str, jobs: list[list[str]] | None) -> str:
    """Write the sweep's record (a fresh id and its planned jobs) before any job starts; the id."""
    os.makedirs(sweep_dir, exist_ok=True)
    sweep_id = uuid.uuid4().hex
    record = {"id": sweep_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "jobs": jobs}
    _write_json(os.path.join(sweep_dir, SWEEP_FILE), record)
    return sweep_id


def read_record(sweep_dir: str) -> dict | None:
    try:
        with open(os.path.join(sweep_dir, SWEEP_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def job_entry(sweep_dir: str, num: int, overrides: list[str]) -> dict:
    """What a job writes into its result.json so that its sweep can find it, on any host."""
    record = read_record(sweep_dir) or {}
    return {"num": num, "overrides": overrides, "sweep_id": record.get("id")}


STARTED_FILE = "started.json"


def mark_started(output_dir: str, job: dict) -> None:
    """Record in a job's folder, as the job starts, that this sweep's job `job` (its
    `job_entry`) started: interrupted before its result, it is a job that ran, not one never run."""
    os.makedirs(output_dir, exist_ok=True)
    _write_json(os.path.join(output_dir, STARTED_FILE), job)


def _job_files(sweep_dir: str, sweep_id: str | None, name: str) -> dict[int, tuple[str, dict]]:
    """Job number -> (output folder, contents) of every `name` file this sweep's jobs wrote (a
    reused sweep folder's files from an earlier sweep carry another id): a result.json holds
    its job's entry under "job", a started.json is one."""
    found: dict[int, tuple[str, dict]] = {}
    for folder, dirs, files in os.walk(sweep_dir):
        dirs[:] = [d for d in dirs if d not in ("logs", "progress", ".submitit")]
        if name not in files:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        job = (data.get("job") if name == "result.json" else data) or {}
        if job.get("sweep_id") == sweep_id and isinstance(job.get("num"), int):
            found[job["num"]] = (folder, data)
    return found


def _results(sweep_dir: str, sweep_id: str | None) -> dict[int, tuple[str, dict]]:
    """Job number -> (output folder, result) of every result.json this sweep's jobs wrote."""
    return _job_files(sweep_dir, sweep_id, "result.json")


def collect_rows(sweep_dir: str, interrupted: bool = False,
                 check: Callable[[str, dict], None] | None = None) -> list[dict]:
    """One row per job of the sweep in `sweep_dir`, from the files its jobs wrote, whichever
    launcher ran them and wherever: a planned job without a result is an ERROR row, or, when
    the sweep was interrupted, a SKIP if it never started (`mark_started`: one that did ran and
    was interrupted, an ERROR). `check(result_path, result)` sees each result before it is
    read (and may raise: a reader that refuses another layout)."""
    record = read_record(sweep_dir) or {}
    found = _results(sweep_dir, record.get("id"))
    started = _job_files(sweep_dir, record.get("id"), STARTED_FILE) if interrupted else {}
    planned = record.get("jobs")
    # A rerun's jobs keep the numbers they had in the sweep it reruns (`launcher.sweep.rerun`).
    numbers = record.get("numbers") or (range(len(planned)) if planned is not None else sorted(found))
    rows = []
    for i, num in enumerate(numbers):
        folder, result = found.get(num, (None, None))
        if result is None and num in started:
            row = job_row(num, planned[i], started[num][0], None)
            row["message"] = "interrupted while it ran: the sweep was stopped before the job wrote its result"
            rows.append(row)
            continue
        if result is None and interrupted:
            rows.append({"job": num, "overrides": planned[i], "output_dir": "-", "status": "skipped",
                         "verdict": "SKIP", "exit_code": EXIT_CODES["SKIP"], "passed": False, "wall_s": None, "failed_tensors": [], "tensor": None,
                         "message": "not run: the sweep was interrupted"})
            continue
        if result is not None and check is not None:
            check(os.path.join(folder, "result.json"), result)
        overrides = result["job"]["overrides"] if result else planned[i]
        rows.append(job_row(num, overrides, folder or "-", result))
    return rows


def write_summary(sweep_dir: str, interrupted: bool = False) -> int:
    """summary.json, junit.xml, report.html and the table of the sweep in `sweep_dir`; its exit
    status."""
    rows = collect_rows(sweep_dir, interrupted)
    counts = {name: sum(r["verdict"] == v for r in rows) for name, v in SUMMARY_COUNTS.items()}
    summary = {**provenance(), "sweep_dir": os.path.abspath(sweep_dir), "n_jobs": len(rows), **counts,
               "interrupted": interrupted, "jobs": rows}
    _write_json(os.path.join(sweep_dir, "summary.json"), summary)
    junit_tree(rows).write(os.path.join(sweep_dir, "junit.xml"), encoding="utf-8", xml_declaration=True)
    page = write_sweep_page(sweep_dir, summary)
    varied = varying_keys(rows)
    print(f"sweep varies: {', '.join(varied) if varied else 'nothing'}")
    print("\n".join(table(rows)))
    unchecked = f", {counts['unchecked']} unchecked" if counts["unchecked"] else ""
    print(f"sweep: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors{unchecked}, "
          f"{counts['skipped']} skipped of {len(rows)}{' (interrupted)' if interrupted else ''}; "
          f"summary.json, junit.xml{' and report.html' if page else ''} in {sweep_dir}")
    return exit_status(rows)


def exit_status(rows: list[dict]) -> int:
    """The worst job's: 2 if any ERROR, else 1 if any FAIL, else 0."""
    return max((EXIT_CODES[r["verdict"]] for r in rows), default=0)


def earlier_job_failed(sweep_dir: str, num: int) -> bool:
    """Whether a job of this sweep numbered below `num` finished without passing (fail_fast)."""
    record = read_record(sweep_dir) or {}
    return any(n < num and verdict(r) in ("FAIL", "ERROR")
               for n, (_, r) in _results(sweep_dir, record.get("id")).items())


def _write_json(path: str, data) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# -- the callback ------------------------------------------------------------------------------


class SweepSummary(Callback):
    """Progress lines per job and, at the end of a multirun, summary.json, junit.xml and a table,
    all built from the files the jobs wrote. The multirun's exit status ends Hydra's application
    (`SystemExit` from `on_multirun_end`, the last of the end callbacks: Hydra drops what a
    sweep returns); a multirun that never reached its end gets its summary from the harness's
    sweeper (`hydra_plugins.dsv4_tp_harness.harness_sweeper`), through which it ended."""

    def __init__(self) -> None:
        # The multirun in flight in this process: its progress lines and its count of jobs.
        self.display: progress.Display | None = None
        self.counter: progress.SweepCounter | None = None

    def __getstate__(self) -> dict:
        # A copy in a pool's worker (joblib and submitit pickle the callbacks) counts no jobs:
        # its lines would count the worker's jobs, not the sweep's (and a display holds a lock).
        return {"display": None, "counter": None}

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        progress.composition_done()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        progress.composition_done()
        jobs = planned_jobs(config)
        start_record(str(config.hydra.sweep.dir), jobs)
        self.display = progress.Display()
        self.counter = progress.SweepCounter(total=len(jobs) if jobs is not None else None)

    # Job callbacks run in the process that runs the job: this one (the harness's launcher)
    # or another (joblib, submitit), whose copy of this callback counts nothing.
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = self.counter
        if sweep is None:
            return
        sweep.current = int(config.hydra.job.num) + 1
        overrides = " ".join(o for o in config.hydra.overrides.task if not o.startswith("hydra."))
        self.display.line(f"{sweep.prefix()}start {overrides}")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        sweep = self.counter
        if sweep is None:
            return
        output_dir = node_output_dir(str(config.hydra.runtime.output_dir), os.environ)
        try:
            with open(os.path.join(output_dir, "result.json")) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = None
        row = job_row(int(config.hydra.job.num), list(config.hydra.overrides.task), output_dir, result)
        sweep.done += 1
        sweep.failed += row["verdict"] != "PASS"
        what = f" {row['message']}" if row.get("message") else ""  # a loosened PASS says so too
        self.display.line(f"{sweep.prefix()}{row['verdict']}{what} ({fmt(row.get('wall_s'))}s); "
                          f"{sweep.done}/{sweep.total or '?'} done, {sweep.failed} not passed")
        sweep.current = None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        status = write_summary(str(config.hydra.sweep.dir))
        self.counter = None
        with contextlib.suppress(ConfigError, OmegaConfBaseException):  # a cap every job refused already
            from launcher.config.spec import golden_cache_of  # imports torch: a sweep's end, never compare's

            cache_usage = cache_dir.usage_line(*golden_cache_of(config))  # once a sweep, not once a job
            if cache_usage:
                print(cache_usage)
        raise SystemExit(status)


def unfinished_status(sweep_dir: str, stopped_by: BaseException) -> int:
    """The summary of a multirun that never reached its end, `stopped_by` what ended it, and
    the process's exit status: interrupted (SIGINT, SIGTERM: the signal's 128 + N), the jobs it
    never started are skips and those it stopped errors; stopped by an error (a Hydra launcher
    that failed, a refused batch), every job without a result is an error, and so is the status."""
    code = 128 + signal.SIGINT if isinstance(stopped_by, KeyboardInterrupt) else getattr(stopped_by, "code", None)
    interrupted = code in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    summary = write_summary(sweep_dir, interrupted=interrupted)
    return code if interrupted else max(summary, EXIT_ERROR)
