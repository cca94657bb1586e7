"""Sweeps: the Hydra callback that reports a multirun, and the resolvers its sweep files use.

`SweepSummary` (registered under `hydra.callbacks` in configs/config.yaml) prints a line as
each job starts and ends, and at the end of the multirun writes, into the sweep directory:

* `summary.json`: `{"sweep_dir", "n_jobs", "passed", "failed", "errors", "skipped", "jobs": [...]}`,
  one entry per job (its overrides, case, verdict, worst tensor and figures, message, wall time);
* `junit.xml`: one testsuite, one testcase per job; a FAIL carries the comparators' messages
  as `<failure>`, a crashed or refused job an `<error>`, a fail_fast skip `<skipped>`;

and prints the same rows as a table on stdout. Every row comes from the job's result.json
(`launcher.cli.execute` writes one for every outcome), so a crashed job has its row too.
Jobs run one after another in this process (Hydra's basic launcher): each launches its own
ranks on a fresh rendezvous port.

The resolvers give sweep files values that depend on the job's own tp and model:
`${capacity:}` is the rank capacity decode_batch*decode_seq/tp and `${capacity:1}` one row
block below it (a row block is lcm(8, decode_seq) tokens); `${row_block_below:}` is the
second token count the reference runs (validation.md §5.3), the capacity itself at tp = 1;
`${mixed_starts:}` is a start position per request of the TP group (`start_pos`'s group form),
drawn in turn from `mixed_pattern` so that every rank's requests start differently (swa.md P11).
"""

from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from layers.case import TOKEN_TILE
from layers.config import ModelConfig

from . import progress

# A job's verdict by its result status; an "ok" run is PASS or FAIL by its comparisons.
VERDICTS = {"ok": None, "error": "ERROR", "config-error": "ERROR", "skipped": "SKIP"}
SUMMARY_COUNTS = {"passed": "PASS", "failed": "FAIL", "errors": "ERROR", "skipped": "SKIP"}


# -- resolvers ---------------------------------------------------------------------------------


def _model(root) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(root.model, resolve=True))


def capacity(blocks_below: int = 0, *, _root_) -> int:
    """The rank capacity of the job's model and tp, less `blocks_below` row blocks."""
    m = _model(_root_)
    return m.decode_tokens // int(_root_.tp) - int(blocks_below) * math.lcm(TOKEN_TILE, m.decode_seq)


def row_block_below(*, _root_) -> int:
    """The second token count of validation.md §5.3: one row block below the capacity for
    tp > 1; at tp = 1 the reference runs the capacity alone, and so does this."""
    return capacity(0 if int(_root_.tp) == 1 else 1, _root_=_root_)


def mixed_pattern(m: ModelConfig) -> list[int]:
    """Starts of every layer's regimes: long context, cold start, the ratio-4 and ratio-128
    boundaries, window edges, state-page and cache-tile crossings (swa.md §7.1, csa.md §6.1,
    hca.md §5.1). Thirteen of them: prime, so no power-of-two rank batch repeats another's."""
    w = m.sliding_window
    return [m.decode_start_pos, 0, 2, 3, 7, 10, 31, 63, w - 1, w, 255, 511, 1023]


def mixed_starts(*, _root_) -> list[int]:
    """One start per request of the TP group, request i taking `mixed_pattern[i % 13]`."""
    m = _model(_root_)
    tp = int(_root_.tp)
    local_t = _root_.local_t if _root_.local_t is not None else m.decode_tokens // tp
    pattern = mixed_pattern(m)
    return [pattern[i % len(pattern)] for i in range(tp * (int(local_t) // m.decode_seq))]


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("capacity", capacity, replace=True)
    OmegaConf.register_new_resolver("row_block_below", row_block_below, replace=True)
    OmegaConf.register_new_resolver("mixed_starts", mixed_starts, replace=True)


# -- one row per job ---------------------------------------------------------------------------


def _worst(verdicts: list[dict]) -> dict | None:
    """The verdict to name in a summary: a failing one first, then the largest max |diff|, then
    the latest in validation order (x_out, the layer's output, comes last)."""
    def key(v):
        return (not v["passed"], v.get("figures", {}).get("max_abs_diff") or 0.0)

    return max(reversed(verdicts), key=key, default=None)


def job_row(num: int, overrides: list[str], output_dir: str, result: dict | None, exit_code: Any) -> dict:
    """A job's summary entry from its result.json (None when the job left none)."""
    row: dict[str, Any] = {"job": num, "overrides": overrides, "output_dir": output_dir, "exit_code": exit_code}
    if result is None:
        row.update(status="error", verdict="ERROR", passed=False, message="the job wrote no result.json",
                   wall_s=None, failed_tensors=[], tensor=None)
        return row
    case = result["case"]
    row.update({k: case.get(k) for k in ("layer", "scope", "model", "tp", "local_t", "start_pos", "seed")})
    row.update(status=result["status"], passed=bool(result["passed"]), wall_s=result.get("wall_s"))
    verdicts = result.get("verdicts", []) + result.get("recomputed_verdicts", [])
    failed = [v for v in verdicts if not v["passed"]]
    row["failed_tensors"] = sorted({v["tensor"] for v in failed})
    worst = _worst(verdicts)
    figures = worst.get("figures", {}) if worst else {}
    row.update(
        tensor=worst["tensor"] if worst else None,
        comparator=worst["label"] if worst else None,
        max_abs_diff=figures.get("max_abs_diff"),
        worst=figures.get("worst"),
        n_bad=figures.get("n_bad"),
        numel=figures.get("numel"),
    )
    row["verdict"] = VERDICTS.get(result["status"], "ERROR") or ("PASS" if result["passed"] else "FAIL")
    if result["status"] != "ok":
        e = result["error"]
        # Named once: a message that already says which rank or stage is kept as it is.
        where = f"rank {e['rank']} " if e.get("rank") is not None and f"rank {e['rank']}" not in e["message"] else ""
        stage = f"in stage '{e['stage']}': " if e.get("stage") and e["stage"] not in e["message"] else ""
        row["message"] = f"{where}{stage}{e['message']}"
        row["traceback"] = e.get("traceback", "")
    else:
        row["message"] = "; ".join(f"{v['tensor']} FAIL ({v['label']})" for v in failed)
        row["details"] = [f"{v['tensor']} FAIL ({v['label']})\n{v['detail']}" for v in failed]
    return row


def _starts_text(start_pos) -> str:
    if start_pos is None:
        return "canonical"
    if isinstance(start_pos, list):
        head = ",".join(str(s) for s in start_pos[:3])
        return f"[{head},...]({len(start_pos)})" if len(start_pos) > 3 else f"[{head}]"
    return str(start_pos)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def table(rows: list[dict]) -> list[str]:
    """The summary table: one line per job, then one line per job that did not pass."""
    head = ["job", "layer", "scope", "model", "tp", "local_t", "start_pos", "verdict", "tensor", "max|diff|", "bad", "wall_s"]
    cells = [head]
    for r in rows:
        bad = f"{r['n_bad']}/{r['numel']}" if r.get("n_bad") is not None else "-"
        cells.append([str(r["job"]), _fmt(r.get("layer")), _fmt(r.get("scope")), _fmt(r.get("model")), _fmt(r.get("tp")),
                      _fmt(r.get("local_t")), _starts_text(r.get("start_pos")), r["verdict"], _fmt(r.get("tensor")),
                      _fmt(r.get("max_abs_diff")), bad, _fmt(r.get("wall_s"))])
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    for r in rows:
        if r["verdict"] != "PASS":
            lines.append(f"job {r['job']} {r['verdict']}: {r['message']}  ({r['output_dir']})")
    return lines


# -- JUnit XML ---------------------------------------------------------------------------------

# XML 1.0 allows tab, newline, carriage return and printable characters only.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _xml_text(s: str) -> str:
    return _NOT_XML.sub("?", s)


def junit_tree(rows: list[dict], suite: str = "dsv4-tp-harness") -> ET.ElementTree:
    counts = {k: sum(r["verdict"] == k for r in rows) for k in ("FAIL", "ERROR", "SKIP")}
    total_s = sum(r.get("wall_s") or 0.0 for r in rows)
    attrs = {"name": suite, "tests": str(len(rows)), "failures": str(counts["FAIL"]), "errors": str(counts["ERROR"]),
             "skipped": str(counts["SKIP"]), "time": f"{total_s:.3f}"}
    root = ET.Element("testsuites", attrs)
    ts = ET.SubElement(root, "testsuite", attrs)
    for r in rows:
        name = f"job{r['job']} " + " ".join(o for o in r["overrides"] if not o.startswith("hydra."))
        tc = ET.SubElement(ts, "testcase", {
            "classname": f"{suite}.{r.get('layer') or 'unknown'}.{r.get('scope') or 'full'}", "name": _xml_text(name.strip()),
            "time": f"{r.get('wall_s') or 0.0:.3f}",
        })
        if r["verdict"] == "FAIL":
            el = ET.SubElement(tc, "failure", {"message": _xml_text(r["message"]), "type": "FAIL"})
            el.text = _xml_text("\n\n".join(r.get("details", [])))
        elif r["verdict"] == "ERROR":
            el = ET.SubElement(tc, "error", {"message": _xml_text(r["message"]), "type": r["status"]})
            el.text = _xml_text(r.get("traceback") or r["message"])
        elif r["verdict"] == "SKIP":
            ET.SubElement(tc, "skipped", {"message": _xml_text(r["message"])})
        out = ET.SubElement(tc, "system-out")
        out.text = f"output_dir: {r['output_dir']}"
    ET.indent(root)
    return ET.ElementTree(root)


# -- the callback ------------------------------------------------------------------------------


def count_jobs(config: DictConfig) -> int | None:
    """How many jobs the basic sweeper makes of this multirun (None for another sweeper)."""
    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = config.hydra.sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()]
    args += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
    return sum(len(b) for b in batches)


class SweepSummary(Callback):
    """Progress lines per job and, at the end of a multirun, summary.json, junit.xml and a table."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.multirun = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.rows, self.multirun = [], True
        progress.SWEEP = progress.SweepCounter(total=count_jobs(config))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.multirun:
            return
        sweep = progress.SWEEP
        sweep.current = int(config.hydra.job.num) + 1
        overrides = " ".join(o for o in config.hydra.overrides.task if not o.startswith("hydra."))
        progress.DISPLAY.line(f"{sweep.prefix()}start {overrides}")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not self.multirun:
            return
        output_dir = str(config.hydra.runtime.output_dir)
        path = os.path.join(output_dir, "result.json")
        result = json.load(open(path)) if os.path.isfile(path) else None
        code = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        row = job_row(int(config.hydra.job.num), list(config.hydra.overrides.task), output_dir, result, code)
        if job_return.status == JobStatus.FAILED:  # the task itself raised: nothing it wrote is to be trusted
            row.update(status="error", verdict="ERROR", passed=False, message=repr(job_return._return_value))
        self.rows.append(row)
        sweep = progress.SWEEP
        sweep.done += 1
        sweep.failed += row["verdict"] != "PASS"
        what = f" {row['message']}" if row["verdict"] != "PASS" and row.get("message") else ""
        progress.DISPLAY.line(f"{sweep.prefix()}{row['verdict']}{what} ({_fmt(row.get('wall_s'))}s); "
                              f"{sweep.done}/{sweep.total or '?'} done, {sweep.failed} not passed")
        sweep.current = None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)
        rows = sorted(self.rows, key=lambda r: r["job"])
        counts = {name: sum(r["verdict"] == v for r in rows) for name, v in SUMMARY_COUNTS.items()}
        summary = {"sweep_dir": os.path.abspath(sweep_dir), "n_jobs": len(rows), **counts, "jobs": rows}
        with open(os.path.join(sweep_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        junit_tree(rows).write(os.path.join(sweep_dir, "junit.xml"), encoding="utf-8", xml_declaration=True)
        print("\n".join(table(rows)))
        print(f"sweep: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
              f"{counts['skipped']} skipped of {len(rows)}; summary.json and junit.xml in {sweep_dir}")
        self.multirun = False
        progress.SWEEP = None
