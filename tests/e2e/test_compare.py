"""Regression tracking: `python -m launcher.compare` on real runs and sweeps (tiny dims)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from launcher.report.regressions import Job, Thresholds, compare
from launcher.report.result import SCHEMA_VERSION

from ..conftest import REPO, run_cli
from ..conftest import multirun


def compare_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.compare", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """A good baseline sweep and a candidate sweep of the same cases whose implementation
    corrupts rank 1's first request (so tp=1 still passes and tp=2 fails)."""
    base, cand = tmp_path_factory.mktemp("baseline"), tmp_path_factory.mktemp("candidate")
    p, summary, _ = multirun(base, "layer=swa", "model=tiny", "tp=1,2")
    assert p.returncode == 0, p.stdout + p.stderr
    p, summary, _ = multirun(cand, "layer=swa", "model=tiny", "tp=1,2", "impl=tests.defects.PerturbRankTokens")
    assert [j["verdict"] for j in summary["jobs"]] == ["PASS", "FAIL"], p.stdout + p.stderr
    return base / "sweep", cand / "sweep"


def test_a_defective_candidate_sweep_regresses_naming_job_and_tensor(sweeps):
    base, cand = sweeps
    p = compare_cli(base, cand)
    assert p.returncode == 1, p.stdout + p.stderr
    regressions = [ln for ln in p.stdout.splitlines() if ln.startswith("REGRESSION")]
    assert regressions and all(ln.startswith("REGRESSION job 1 (swa tiny tp=2 local_t=64") for ln in regressions), p.stdout
    assert any("verdict PASS -> FAIL: x_out FAIL" in ln for ln in regressions)
    assert any("x_out max|diff| 0 -> " in ln for ln in regressions)
    assert "compare: 2 matched, 1 regressed, 0 only in the baseline, 0 only in the candidate" in p.stdout

    report = json.loads(compare_cli(base, cand, "--json").stdout)
    assert report["regressed"] is True
    tp1, tp2 = sorted(report["matched"], key=lambda m: m["case"]["tp"])
    assert tp1["regressions"] == [] and tp1["verdict_now"] == "PASS"
    assert (tp2["verdict_then"], tp2["verdict_now"]) == ("PASS", "FAIL")
    x_out = next(t for t in tp2["tensors"] if t["tensor"] == "x_out")
    assert x_out["regressed"] and x_out["then"] == 0 and x_out["now"] > 0.1


def test_the_same_sweep_and_two_identical_runs_do_not_regress(sweeps, tmp_path):
    base, _ = sweeps
    p = compare_cli(base, base)
    assert p.returncode == 0 and "0 regressed" in p.stdout, p.stdout + p.stderr
    # A fresh single run of job 1's case, a separate process: its figures are the same.
    run = run_cli(["layer=swa", "model=tiny", "tp=2"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    p = compare_cli(base / "1", tmp_path / "out", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["matched"][0]["regressions"] == []
    # Against the whole sweep the run matches job 1 alone: job 0, which passed, is missing.
    p = compare_cli(base, tmp_path / "out")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REGRESSION job 0 (swa tiny tp=1 local_t=128 seed=20260819): PASS in the baseline, no candidate job " \
           "of its case" in p.stdout, p.stdout
    assert "unmatched, only baseline: job 0 (swa tiny tp=1 local_t=128" in p.stdout
    assert "compare: 1 matched, 1 regressed, 1 only in the baseline, 0 only in the candidate" in p.stdout


def test_a_grown_error_and_a_slower_median_are_regressions(sweeps, tmp_path):
    # The baseline's own result, with the candidate's figures edited: the rules, not the runs.
    base, _ = sweeps
    cand = tmp_path / "cand"
    shutil.copytree(base / "1", cand)
    result = json.loads((cand / "result.json").read_text())
    x_out = next(v for v in result["verdicts"] if v["tensor"] == "x_out")
    x_out["figures"]["max_abs_diff"] = 3e-3  # still a PASS, 30x the floor
    (cand / "result.json").write_text(json.dumps(result))
    p = compare_cli(base / "1", cand)
    assert p.returncode == 1 and "x_out max|diff| 0 -> 0.003 (more than x2)" in p.stdout, p.stdout
    assert compare_cli(base / "1", cand, "--error-floor", "0.01").returncode == 0


def test_benchmark_medians_then_and_now():
    def job(median):
        return Job(label="j", case={"layer": "swa", "tp": 2}, verdict="PASS", errors={"x_out": 0.0},
                   bench_median_s=median)

    t = Thresholds(slower=0.10)
    assert compare([job(0.100)], [job(0.109)], t)["regressed"] is False
    report = compare([job(0.100)], [job(0.120)], t)
    assert report["regressed"] and "bench median 100 ms -> 120 ms" in report["matched"][0]["regressions"][0]
    assert compare([job(None)], [job(0.5)], t)["regressed"] is False  # no baseline median: nothing to compare


def test_a_refused_or_new_failing_candidate_job_is_a_regression(sweeps, tmp_path):
    base, _ = sweeps
    # A refused job states only the keys it was given (local_t reads None): still matched.
    p, summary, _ = multirun(tmp_path, "layer=swa", "model=tiny", "tp=2", "impl=nowhere.Impl")
    assert summary["jobs"][0]["verdict"] == "ERROR"
    p = compare_cli(base, tmp_path / "sweep")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REGRESSION job 0 (swa tiny tp=2 local_t=64 seed=20260819): verdict PASS -> ERROR" in p.stdout, p.stdout
    # A failing job of a case the baseline never ran cannot be shown to have failed before.
    new = compare([Job("a", {"layer": "swa", "tp": 1}, "PASS")], [Job("b", {"layer": "hca", "tp": 1}, "FAIL")],
                  Thresholds())
    assert new["regressed"] and new["unmatched_candidate_not_passed"] == ["b"]


def test_a_folder_that_is_neither_is_refused_in_one_line(tmp_path):
    p = compare_cli(tmp_path, tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == f"error: {tmp_path} holds no result.json, sweep.json or summary.json: not a run or sweep folder"


def test_folders_without_a_case_in_common_are_an_error_not_a_pass(sweeps):
    base, cand = sweeps
    p = compare_cli(base / "0", cand / "1")  # tp=1 against tp=2: nothing to compare
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.strip() == f"error: no job of {cand / '1'} (1) has the case of a job of {base / '0'} (1): " \
                               "nothing was compared"


@pytest.mark.parametrize("option", ["--error-factor", "--error-floor", "--slower"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_threshold_that_is_not_a_finite_number_is_refused(sweeps, tmp_path, option, value):
    base, _ = sweeps
    cand = tmp_path / "cand"
    shutil.copytree(base / "1", cand)
    result = json.loads((cand / "result.json").read_text())
    next(v for v in result["verdicts"] if v["tensor"] == "x_out")["figures"]["max_abs_diff"] = 3e-3
    (cand / "result.json").write_text(json.dumps(result))
    assert compare_cli(base / "1", cand).returncode == 1  # the growth the threshold would hide
    p = compare_cli(base / "1", cand, option, value)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert "must be a finite number" in p.stderr


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "result.json" if (dst / "result.json").is_file() else dst / "1" / "result.json"
    result = json.loads(path.read_text())
    edit(result)
    path.write_text(json.dumps(result))
    return path


def _earlier_layout(result):
    """A result of the layout before schema_version: no provenance, no verdict tallies."""
    del result["schema_version"]
    for v in result["verdicts"]:
        del v["tally"]


@pytest.mark.parametrize("edit, written", [(_earlier_layout, "None"),
                                           (lambda r: r.update(schema_version=SCHEMA_VERSION + 1), SCHEMA_VERSION + 1)])
@pytest.mark.parametrize("what", ["run", "sweep"])
def test_a_result_of_another_schema_version_is_an_error_naming_it(sweeps, tmp_path, edit, written, what):
    base, _ = sweeps
    src = base / "1" if what == "run" else base
    path = _edited(src, tmp_path / "cand", edit)
    for args in ((src, tmp_path / "cand"), (tmp_path / "cand", src)):
        p = compare_cli(*args)
        assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
        assert p.stderr.strip() == f"error: {path}: schema_version {written}, this tool reads schema_version " \
                                   f"1 and {SCHEMA_VERSION} only (compare it with the version that wrote it)"


def _version_1(result):
    """A result as schema_version 1 wrote it: the error entry's phase named `stage`."""
    result["schema_version"] = 1
    if result.get("error"):
        result["error"]["stage"] = result["error"].pop("phase")


@pytest.mark.parametrize("what", ["run", "sweep"])
def test_a_schema_version_1_result_is_compared_with_a_version_2_one(sweeps, tmp_path, what):
    base, cand = sweeps
    src = base / "1" if what == "run" else base
    _edited(src, tmp_path / "then", _version_1)
    p = compare_cli(tmp_path / "then", src)
    assert p.returncode == 0 and "0 regressed" in p.stdout, p.stdout + p.stderr
    if what == "sweep":  # a version 1 baseline against a failing candidate still regresses
        assert compare_cli(tmp_path / "then", cand).returncode == 1


def test_an_unforeseen_exception_exits_2_never_the_regression_status(monkeypatch, sweeps, capsys):
    import launcher.compare as cli

    def broken(path):
        raise RuntimeError("a reader bug")

    monkeypatch.setattr(cli, "load", broken)
    base, _ = sweeps
    assert cli.run([str(base), str(base)]) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == "error: RuntimeError: a reader bug\n"
