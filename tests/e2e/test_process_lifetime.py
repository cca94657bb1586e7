"""The launcher's processes live and die with it: killed outright, it leaves no rank, forkserver
or resource tracker behind and closes its caller's pipes, under joblib too (its workers and
their job processes); what a rank's implementation starts ends with the rank, after a passing
run as after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import REPO
from ..defects import CHILD_PIDS_ENV

pytestmark = pytest.mark.timeout(300)


def session_processes(sid: int) -> list[int]:
    """Live processes of session `sid` (the launcher starts one; its ranks, forkserver and
    resource tracker stay in it), zombies left out."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, _pgrp, session = stat.read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def start_launcher(out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", *args, f"hydra.run.dir={out}"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )


def wait_for_events(out: Path, wanted: dict[int, tuple[str, str]], timeout: float = 600) -> None:
    """Until each rank's progress has its wanted (stage, event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = set()
        for rank, (stage, event) in wanted.items():
            path = out / "progress" / f"rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            if any(json.loads(ln)["phase"] == stage and json.loads(ln)["event"] == event for ln in lines if ln.strip()):
                seen.add(rank)
        if seen == set(wanted):
            return
        time.sleep(0.05)
    raise AssertionError(f"the ranks never reached {wanted}")


def assert_no_process_left(sid: int, within_s: float = 10) -> None:
    """No live process of session `sid` within `within_s` (the kernel delivers a parent-death
    signal as the parent exits; the child may take a moment to end)."""
    deadline = time.monotonic() + within_s
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {}
    for pid in session_processes(sid):
        try:
            left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
    assert left == {}


def assert_all_gone(proc: subprocess.Popen) -> None:
    """Within 10 s of the kill: both pipes at EOF (no process holds them) and no process left."""
    proc.communicate(timeout=10)  # raises TimeoutExpired while any process holds a pipe open
    assert_no_process_left(proc.pid)


def test_sigkill_while_a_rank_hangs_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    proc = start_launcher(out, "layer=swa", "tp=2", "model=tiny", "timeout_s=120", "fault.kind=hang", "fault.rank=1")
    wait_for_events(out, {1: ("layer", "start")})
    proc.kill()
    assert_all_gone(proc)


def test_sigkill_after_the_ranks_finished_leaves_nothing(tmp_path):
    # The launcher is frozen once every rank is past its rendezvous, so the ranks finish their
    # work and block in elastic's wrapper, waiting for a reader that never comes.
    out = tmp_path / "out"
    proc = start_launcher(out, "layer=csa", "tp=2", "model=small", "timeout_s=120", "golden_cache=null")
    wait_for_events(out, {0: ("fixture", "start"), 1: ("fixture", "start")})
    proc.send_signal(signal.SIGSTOP)
    assert proc.poll() is None and not (out / "result.json").exists(), "the run ended before the launcher was stopped"
    wait_for_events(out, {0: ("compare", "done"), 1: ("gather", "done")})
    proc.kill()
    assert_all_gone(proc)


def recorded_children(folder: Path, ranks: int) -> list[int]:
    """The pids `tests.defects.StartsAChildProcess` recorded, one per rank."""
    pids = [int(p.read_text()) for p in sorted(folder.glob("rank*.pid"))]
    assert len(pids) == ranks, pids
    return pids


def test_what_the_ranks_started_ends_with_a_passing_run(tmp_path):
    children = tmp_path / "children"
    children.mkdir()
    proc = start_launcher(tmp_path / "out", "layer=swa", "tp=2", "model=tiny", "impl=tests.defects.StartsAChildProcess",
                          env={CHILD_PIDS_ENV: str(children)})
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout.decode() + stderr.decode()
    recorded_children(children, 2)  # both were started
    assert_no_process_left(proc.pid)  # the children were in the launcher's session: none is left


def test_sigkill_leaves_nothing_the_ranks_started(tmp_path):
    children = tmp_path / "children"
    children.mkdir()
    out = tmp_path / "out"
    proc = start_launcher(out, "layer=swa", "tp=2", "model=tiny", "timeout_s=120", "impl=tests.defects.StartsAChildProcess",
                          "fault.kind=hang", "fault.rank=1", "fault.phase=gather", env={CHILD_PIDS_ENV: str(children)})
    wait_for_events(out, {1: ("gather", "start")})  # after the layer: both children are running
    pids = recorded_children(children, 2)
    assert set(pids) <= set(session_processes(proc.pid))
    proc.kill()
    assert_all_gone(proc)


def rank_pid(out: Path, rank: int) -> int:
    return json.loads((out / "progress" / f"rank{rank}.pid").read_text())["pid"]


@pytest.mark.parametrize("tp, rank, stage, why", [
    (1, 0, "golden", "past its own deadline"),  # no peer times out, and its deadline thread is frozen
    (2, 1, "layer", "after its peers had ended"),  # rank 0 times out; a stopped rank ignores SIGTERM
])
def test_a_frozen_rank_is_killed_and_named(tmp_path, tp, rank, stage, why):
    out = tmp_path / "out"
    proc = start_launcher(out, "layer=swa", f"tp={tp}", "model=tiny", "timeout_s=5", "golden_cache=null",
                          "fault.kind=hang", f"fault.rank={rank}", f"fault.phase={stage}")
    wait_for_events(out, {rank: (stage, "start")})
    os.kill(rank_pid(out, rank), signal.SIGSTOP)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 2, stdout + stderr
    err = json.loads((out / "result.json").read_text())["error"]
    assert (err["rank"], err["phase"]) == (rank, stage), err
    assert f"rank {rank} was frozen (process state T" in err["message"] and why in err["message"], err
    assert f"rank {rank} failed in phase '{stage}'" in stdout.decode()
    assert_no_process_left(proc.pid)


def start_sweep(sweep_dir: Path, *args: str) -> subprocess.Popen:
    """A sweep whose jobs hang in rank 1's layer stage, with `args` (its launcher, its jobs)."""
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", "-m", "layer=swa", "model=tiny", "tp=2", "timeout_s=120", "fault.kind=hang",
         "fault.rank=1", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )


def start_joblib_sweep(sweep_dir: Path) -> subprocess.Popen:
    """A joblib sweep whose first two jobs (running at once) hang in their layer stage, and a
    third that waits for a free worker."""
    return start_sweep(sweep_dir, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=1,2,3")


def assert_interrupted_summary(proc: subprocess.Popen, sweep_dir: Path, ran: set[int], n_jobs: int) -> None:
    """Exit status 128 + SIGTERM and a summary in which the jobs in `ran` (started, then
    interrupted) are errors that say so, and the others skips never run."""
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stdout.decode() + stderr.decode()
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["n_jobs"] == n_jobs, summary
    assert (summary["passed"], summary["errors"], summary["skipped"]) == (0, len(ran), n_jobs - len(ran)), summary
    for row in summary["jobs"]:
        if row["job"] in ran:
            assert row["verdict"] == "ERROR" and "interrupted" in row["message"], row
            assert "not run" not in row["message"], row
        else:
            assert (row["verdict"], row["message"]) == ("SKIP", "not run: the sweep was interrupted"), row
    assert (sweep_dir / "junit.xml").is_file()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_a_joblib_sweep_leaves_nothing(tmp_path, sig):
    sweep_dir = tmp_path / "sweep"
    proc = start_joblib_sweep(sweep_dir)
    for job in ("0", "1"):
        wait_for_events(sweep_dir / job, {1: ("layer", "start")})
    # The pool's workers, their job processes, forkservers, ranks and resource trackers.
    descendants = set(session_processes(proc.pid)) - {proc.pid}
    assert len(descendants) >= 2 * 2 + 2, descendants  # at least both jobs' ranks and their workers
    proc.send_signal(sig)
    if sig == signal.SIGTERM:  # an interruption, reported as one: jobs 0 and 1 ran, job 2 never started
        assert_interrupted_summary(proc, sweep_dir, ran={0, 1}, n_jobs=3)
    else:
        proc.communicate(timeout=60)
    assert_no_process_left(proc.pid)  # every descendant was in the sweep's session


def test_sigterm_of_a_sweep_under_the_harness_launcher_reports_the_running_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = start_sweep(sweep_dir, "seed=1,2")  # the harness's own launcher: one job at a time
    wait_for_events(sweep_dir / "0", {1: ("layer", "start")})
    proc.send_signal(signal.SIGTERM)
    assert_interrupted_summary(proc, sweep_dir, ran={0}, n_jobs=2)
    assert_no_process_left(proc.pid)


def loky_workers(launcher: int) -> set[int]:
    """The launcher's children that are loky workers (loky starts each as a fresh interpreter)."""
    workers = set()
    for pid in session_processes(launcher):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if ppid == launcher and b"popen_loky" in cmdline:
            workers.add(pid)
    return workers


def test_sigkill_of_a_joblib_sweep_ends_its_idle_workers(tmp_path):
    # Four workers for two jobs: two of them never get a job, and must end with the launcher
    # all the same, not at loky's idle timeout minutes later.
    sweep_dir = tmp_path / "sweep"
    proc = start_sweep(sweep_dir, "hydra/launcher=joblib", "hydra.launcher.n_jobs=4", "seed=1,2")
    for job in ("0", "1"):
        wait_for_events(sweep_dir / job, {1: ("layer", "start")})
    assert len(loky_workers(proc.pid)) == 4, loky_workers(proc.pid)  # loky starts all of them at once
    recorded = set(session_processes(proc.pid)) - {proc.pid}
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30  # a safety net: the kernel ends them as the launcher ends
    while (left := recorded & set(session_processes(proc.pid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # not left to linger on this machine for minutes
        os.kill(pid, signal.SIGKILL)
    assert left == set()
    proc.communicate(timeout=10)  # no process holds the sweep's pipes
