"""`compose_all`, the sweeper's composition of a batch on forked copies of the launcher: every
job composed once, in job order, the first bad job's own error raised in the launcher, and a
copy that dies, gets stuck or cannot be forked costing time, never a config or a hang."""

from __future__ import annotations

import os
import time

import pytest

from hydra_plugins.dsv4_tp_harness import harness_sweeper

JOBS = [[f"tp={tp}"] for tp in (1, 2, 4, 8, 16, 32)]
LAUNCHER = os.getpid()


def _recording(path, fail=(), in_copy=None):
    """A composition that appends "pid job" to `path`; raises for a job in `fail`; in a copy
    (not this test's process) `in_copy(job)` may die or hang first."""

    def compose(job):
        if in_copy and os.getpid() != LAUNCHER:
            in_copy(job)
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {job[0]}\n")
        if job[0] in fail:
            raise ValueError(f"cannot compose {job[0]}")
        return {"job": job[0], "pid": os.getpid()}

    return compose


def _log(path) -> list[tuple[int, str]]:
    return [(int(pid), job) for pid, job in (line.split() for line in path.read_text().splitlines())]


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


def test_every_job_once_in_job_order_on_two_processes(tmp_path, two_cores):
    log = tmp_path / "log"
    configs = harness_sweeper.compose_all(_recording(log), JOBS)
    assert [c["job"] for c in configs] == [j[0] for j in JOBS]
    assert sorted(job for _, job in _log(log)) == sorted(j[0] for j in JOBS)  # each once
    by = {c["job"]: c["pid"] for c in configs}
    assert {by[j[0]] for j in JOBS[0::2]} == {LAUNCHER} and LAUNCHER not in {by[j[0]] for j in JOBS[1::2]}


def test_one_job_or_one_core_composes_here(tmp_path, monkeypatch):
    log = tmp_path / "log"
    assert [c["pid"] for c in harness_sweeper.compose_all(_recording(log), JOBS[:1])] == [LAUNCHER]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert {c["pid"] for c in harness_sweeper.compose_all(_recording(log), JOBS)} == {LAUNCHER}


@pytest.mark.parametrize("bad", [["tp=2", "tp=4"], ["tp=4", "tp=8"]])  # the first bad one composed by a copy, or here
def test_the_first_bad_job_raises_its_own_error_here(tmp_path, two_cores, bad):
    with pytest.raises(ValueError, match=f"cannot compose {bad[0]}$"):
        harness_sweeper.compose_all(_recording(tmp_path / "log", fail=bad), JOBS)


def test_a_copy_that_dies_leaves_its_jobs_to_the_launcher(tmp_path, two_cores):
    log = tmp_path / "log"
    configs = harness_sweeper.compose_all(_recording(log, in_copy=lambda job: os._exit(3) if job == ["tp=8"] else None), JOBS)
    assert [c["job"] for c in configs] == [j[0] for j in JOBS]
    assert {c["pid"] for c in configs} == {LAUNCHER}  # the copy's two earlier configs were never sent
    assert [job for pid, job in _log(log) if pid == LAUNCHER] == ["tp=1", "tp=4", "tp=16", "tp=2", "tp=8", "tp=32"]


def test_no_process_to_fork_composes_everything_here(tmp_path, two_cores, monkeypatch):
    def no_fork():
        raise BlockingIOError("Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    configs = harness_sweeper.compose_all(_recording(tmp_path / "log"), JOBS)
    assert [c["job"] for c in configs] == [j[0] for j in JOBS] and {c["pid"] for c in configs} == {LAUNCHER}


def test_a_stuck_copy_is_ended_at_its_deadline(tmp_path, two_cores, monkeypatch):
    monkeypatch.setattr(harness_sweeper, "COPY_GRACE_S", 1.0)
    monkeypatch.setattr(harness_sweeper, "COPY_S_PER_JOB", 0.0)
    log = tmp_path / "log"
    start = time.monotonic()
    configs = harness_sweeper.compose_all(_recording(log, in_copy=lambda job: time.sleep(3600)), JOBS)
    assert time.monotonic() - start < 30
    assert [c["job"] for c in configs] == [j[0] for j in JOBS] and {c["pid"] for c in configs} == {LAUNCHER}
