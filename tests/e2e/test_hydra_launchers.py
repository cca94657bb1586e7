"""Sweeps under Hydra's own launcher plugins: the verdict comes from the jobs' files, whichever
process or host ran them, and a sweep that never reaches its end still gets its summary.

Every sweep has a passing job, a failing one (a defective implementation) and a crashing one
(rank 1 dies), run for real by submitit's local executor (each job a process of its own) and
by joblib with two jobs at once (each job in a loky worker).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.report.result import EXIT_ERROR

from ..conftest import REPO, multirun
from ..defects import KILL_AFTER_ENV

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

IMPLS = "layers.tp.TorchTP,tests.defects.PerturbRankTokens,tests.defects.CrashOnRank1"


@pytest.mark.parametrize("launcher", [
    ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"],
    ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
], ids=["submitit_local", "joblib"])
def test_any_hydra_launcher_gives_the_worst_jobs_verdict(tmp_path, launcher):
    p, summary, junit = multirun(tmp_path, *launcher, "layer=swa", "model=tiny", "tp=2", f"impl._target_={IMPLS}")
    assert p.returncode == EXIT_ERROR, p.stdout + p.stderr
    assert summary["n_jobs"] == 3 and (summary["passed"], summary["failed"], summary["errors"]) == (1, 1, 1)
    verdicts = [j["verdict"] for j in summary["jobs"]]
    assert verdicts == ["PASS", "FAIL", "ERROR"], summary
    assert "rank 1" in summary["jobs"][2]["message"]
    suite = junit.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "1")


def test_a_job_that_left_no_result_is_an_error_row(tmp_path):
    # The job's own process is killed (as the OOM killer or a lost node would end it): it
    # writes nothing, and the sweep's summary still has its row.
    p, summary, _ = multirun(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
                             "layer=swa", "model=tiny", "tp=1", "impl._target_=layers.tp.TorchTP,tests.defects.KillJobProcess")
    assert p.returncode == EXIT_ERROR, p.stdout + p.stderr
    jobs = summary["jobs"]
    assert [j["verdict"] for j in jobs] == ["PASS", "ERROR"]
    assert "wrote no result.json" in jobs[1]["message"]




def test_a_joblib_job_whose_process_dies_takes_no_other_job_with_it(tmp_path):
    # The first job kills its own process (SIGKILL, as the OOM killer would) while the second
    # runs beside it (its rank has started) and before the third could start (it waits for a
    # free worker): both have their own verdicts, and the first its own error.
    sweep_dir = tmp_path / "sweep"
    env = {KILL_AFTER_ENV: str(sweep_dir / "1" / "progress" / "rank0.jsonl")}
    p, summary, _ = multirun(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "layer=swa", "model=tiny",
                             "tp=1", "impl._target_=tests.defects.KillJobProcessOnceAFileExists,layers.tp.TorchTP,"
                             "layers.tp.TorchTP", env=env)
    assert p.returncode == EXIT_ERROR, p.stdout + p.stderr
    jobs = summary["jobs"]
    assert [j["verdict"] for j in jobs] == ["ERROR", "PASS", "PASS"], summary
    assert "the job's process was killed by SIGKILL before it wrote its result" in jobs[0]["message"], jobs[0]


@pytest.mark.timeout(400)
def test_ctrl_c_in_a_sweep_leaves_its_summary(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "-m", "layer=swa", "model=tiny", "tp=2", "timeout_s=60",
         "fault.kind=null,hang,null", "fault.rank=1", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    progress = sweep_dir / "1" / "progress" / "rank1.jsonl"
    deadline = time.monotonic() + 300
    while not (progress.exists() and '"layer", "event": "start"' in progress.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert progress.exists(), "the second job never reached its layer stage"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGINT, out
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert [j["verdict"] for j in summary["jobs"]] == ["PASS", "ERROR", "SKIP"], summary
    assert "interrupted" in summary["jobs"][1]["message"]
    assert (sweep_dir / "junit.xml").is_file()
