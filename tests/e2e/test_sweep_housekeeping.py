"""Sweep housekeeping: `python -m launcher.sweep list` (no job runs) and `rerun` (only the jobs
that did not pass), with real sweeps at tiny dims."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..conftest import REPO
from ..conftest import multirun


def sweep_cli(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.sweep", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=400)


def test_list_names_and_checks_every_job_and_runs_none(tmp_path):
    p = sweep_cli("list", "layer=swa,hca", "tp=1,3", "model=tiny", cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr  # some job would be refused
    lines = p.stdout.splitlines()
    assert lines[1].split()[:5] == ["0", "ok", "swa", "full", "tiny"] and lines[1].endswith("layer=swa tp=1 model=tiny")
    assert lines[2].split()[:3] == ["1", "refused", "-"] and lines[2].endswith("layer=swa tp=3 model=tiny")
    assert lines[4].endswith("layer=hca tp=3 model=tiny")
    assert "job 3 refused: tp=3 must divide o_groups=8 of model 'tiny'" in p.stdout
    assert "sweep: 4 jobs, 2 would be refused (keys and case rules checked; each run also checks" in p.stdout
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()  # nothing ran


def test_list_expands_a_named_sweep(tmp_path):
    p = sweep_cli("list", "+sweep=smoke", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sweep: 6 jobs, 0 would be refused" in p.stdout
    assert "hca full tiny tp=8 local_t=16" in p.stdout


def test_rerun_runs_only_the_jobs_that_did_not_pass(tmp_path):
    p, summary, _ = multirun(tmp_path, "layer=swa", "model=tiny", "tp=2",
                             "impl=layers.tp.TorchTP,tests.defects.PerturbRankTokens")
    assert [j["verdict"] for j in summary["jobs"]] == ["PASS", "FAIL"]
    sweep_dir = tmp_path / "sweep"
    # Two jobs of one case that differ in impl alone: the table says which is which, and the
    # sweep says what it varies.
    assert "sweep varies: impl" in p.stdout, p.stdout
    head = next(line for line in p.stdout.splitlines() if line.startswith("job "))
    assert "impl" in head.split(), p.stdout
    assert any(line.split()[:1] == ["1"] and "tests.defects.PerturbRankTokens" in line for line in p.stdout.splitlines())
    # A passing job is one progress row; only the failing one prints its full report.
    assert p.stdout.count("VERDICT: ") == 1 and "VERDICT: FAIL" in p.stdout, p.stdout

    listed = sweep_cli("rerun", sweep_dir, "--list", cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.splitlines()[0] == (
        "job 1 FAIL: layer=swa model=tiny tp=2 impl=tests.defects.PerturbRankTokens"), listed.stdout
    assert "rerun: 1 jobs of" in listed.stdout

    # Rerun as it was: the defect is still there, and the rerun's own sweep says so.
    again = sweep_cli("rerun", sweep_dir, "--into", tmp_path / "again", cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    rerun_summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert [(j["verdict"], j["overrides"]) for j in rerun_summary["jobs"]] == [
        ("FAIL", ["layer=swa", "model=tiny", "tp=2", "impl=tests.defects.PerturbRankTokens"])]
    assert (tmp_path / "again" / "junit.xml").is_file()
    # The rerun keeps the job's number: "rerun of job 1" is job 1 of the rerun's table and page too.
    assert "rerun of job 1:" in again.stderr and [j["job"] for j in rerun_summary["jobs"]] == [1]
    assert any(line.split()[:2] == ["1", "swa"] for line in again.stdout.splitlines()), again.stdout
    assert "job 1 FAIL:" in again.stdout and "job 0" not in again.stdout

    # With the fix given as an override (it replaces the job's own impl): it passes.
    fixed = sweep_cli("rerun", sweep_dir, "impl=layers.tp.TorchTP", "--into", tmp_path / "fixed", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    jobs = json.loads((tmp_path / "fixed" / "summary.json").read_text())["jobs"]
    assert [(j["verdict"], j["overrides"]) for j in jobs] == [
        ("PASS", ["layer=swa", "model=tiny", "tp=2", "impl=layers.tp.TorchTP"])]

    # A rerun's folder is a sweep folder: it can be rerun in turn.
    listed = sweep_cli("rerun", tmp_path / "again", "--list", cwd=tmp_path)
    assert listed.stdout.startswith("job 1 FAIL: layer=swa model=tiny tp=2 impl=tests.defects.PerturbRankTokens")

    # Into a folder that holds anything (the sweep itself, an earlier rerun): refused, nothing
    # of what it holds rewritten, its passing job's result included.
    for folder in (sweep_dir, tmp_path / "again"):
        files = [f for f in folder.rglob("*") if f.is_file()]
        before = {f: f.read_bytes() for f in files}
        assert {"summary.json", "junit.xml", "report.html", "sweep.json", "result.json"} <= {f.name for f in files}
        refused = sweep_cli("rerun", sweep_dir, "impl=layers.tp.TorchTP", "--into", folder, cwd=tmp_path)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.startswith(f"error: --into {folder} is not empty (it holds "), refused.stderr
        assert {f: f.read_bytes() for f in folder.rglob("*") if f.is_file()} == before


def test_rerun_of_a_folder_that_is_no_sweep_is_refused(tmp_path):
    p = sweep_cli("rerun", tmp_path, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"error: {tmp_path} is not a sweep folder (it has no summary.json or sweep.json)")
