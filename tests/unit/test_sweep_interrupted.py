"""An interrupted sweep's rows: a job that started is an ERROR that says it was interrupted
while it ran; only a job that never started (in this sweep) is a SKIP, "not run"."""

from __future__ import annotations

import os

from launcher.report.sweep_summary import collect_rows, job_entry, mark_started, start_record


def test_a_started_job_without_result_is_an_interrupted_error(tmp_path):
    earlier = tmp_path / "earlier"
    start_record(str(earlier), [["seed=1"], ["seed=2"], ["seed=3"]])
    sweep = str(tmp_path / "sweep")
    start_record(sweep, [["seed=1"], ["seed=2"], ["seed=3"]])
    mark_started(os.path.join(sweep, "0"), job_entry(sweep, 0, ["seed=1"]))
    # Job 1's folder is reused from an earlier sweep that started it there: not this sweep's start.
    mark_started(os.path.join(sweep, "1"), job_entry(str(earlier), 1, ["seed=2"]))

    rows = collect_rows(sweep, interrupted=True)
    assert [(r["job"], r["verdict"]) for r in rows] == [(0, "ERROR"), (1, "SKIP"), (2, "SKIP")]
    assert rows[0]["message"].startswith("interrupted while it ran")
    assert rows[0]["output_dir"] == os.path.join(sweep, "0")
    assert [r["message"] for r in rows[1:]] == ["not run: the sweep was interrupted"] * 2

    # Not interrupted (its launcher failed): every job without a result is an error, as before.
    assert [r["verdict"] for r in collect_rows(sweep)] == ["ERROR"] * 3
