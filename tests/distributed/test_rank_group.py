"""The launcher's own rank processes (`launcher.run.rank_group`): which warm group a job gets."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

import launcher.cli  # noqa: F401  (registers the config schemas)
from launcher.config.spec import run_spec
from launcher.run import forkserver
from launcher.run.rank_group import GroupPool

from ..conftest import compose_config


def _spec(tmp_path, *overrides: str):
    return run_spec(compose_config("layer=swa", "model=tiny", *overrides), str(tmp_path / "out"))


@pytest.fixture
def pool():
    forkserver.start()
    groups = GroupPool()
    yield groups
    groups.close()


def test_a_job_gets_the_warm_group_of_its_shape_and_no_other(tmp_path, pool):
    one, two = pool.take(_spec(tmp_path, "tp=1")), pool.take(_spec(tmp_path, "tp=2"))
    pool.keep(one)
    pool.keep(two)
    assert pool.take(_spec(tmp_path, "tp=2")) is two
    assert pool.take(_spec(tmp_path, "tp=2", "timeout_s=30")) is not one  # another timeout: new processes
    pool.keep(two)
    assert pool.take(_spec(tmp_path, "tp=1")) is one


def test_a_group_whose_rank_died_while_idle_is_not_handed_out(tmp_path, pool):
    spec = _spec(tmp_path, "tp=2")
    group = pool.take(spec)
    pool.keep(group)
    os.kill(group.procs[1].pid, signal.SIGKILL)
    group.procs[1].join()
    fresh = pool.take(spec)
    assert fresh is not group and fresh.alive() and not any(p.is_alive() for p in group.procs)
    fresh.stop()


def test_on_accelerators_a_node_holds_one_group_at_a_time(tmp_path, pool):
    kept = [pool.take(_spec(tmp_path, f"tp={tp}")) for tp in (1, 2)]
    for group in kept:
        pool.keep(group)
    # Only started, never given a job: nothing touches a device on this CPU-only machine.
    taken = pool.take(dataclasses.replace(_spec(tmp_path, "tp=2"), backend="nccl"))
    assert not any(p.is_alive() for group in kept for p in group.procs)
    taken.stop()


def test_closing_the_pool_lets_every_groups_ranks_leave_on_their_own(tmp_path, pool):
    kept = [pool.take(_spec(tmp_path, f"tp={tp}")) for tp in (1, 2, 4)]
    for group in kept:
        pool.keep(group)
    pool.close()
    procs = [p for group in kept for p in group.procs]
    assert not any(p.is_alive() for p in procs)
    assert all(p.exitcode >= 0 for p in procs), [p.exitcode for p in procs]  # none ended by a signal


def test_ranks_that_ran_jobs_leave_at_once_and_quietly(tmp_path, pool):
    """Told to leave after their jobs, the ranks of two groups exit with status 0 and nothing
    in their logs: no peer reports a connection its group's other ranks closed."""
    logs = tmp_path / "logs"
    groups = []
    for tp in (2, 4):
        spec = _spec(tmp_path, f"tp={tp}")
        group = pool.take(spec)
        results, failures = group.run(spec, f"tp{tp}", str(logs))
        assert failures is None and all(r["passed"] for r in results.values())
        pool.keep(group)
        groups.append(group)
    pool.close()
    assert [p.exitcode for group in groups for p in group.procs] == [0] * 6
    stderr = {path: path.read_text() for path in logs.glob("*/attempt_0/*/stderr.log")}
    assert len(stderr) == 6
    assert {path: [ln for ln in text.splitlines() if " INFO " not in ln] for path, text in stderr.items()} == {
        path: [] for path in stderr}


def test_the_ranks_still_in_a_job_may_end_on_their_own_after_a_peer_died(tmp_path, pool):
    """Rank 1 dies first; rank 0 raises its own error half a second later. It is let end by
    itself and its report is read (stopped at rank 1's death, its report would be lost)."""
    spec = _spec(tmp_path, "tp=2", "impl._target_=tests.defects.Rank1DiesThenRank0Fails")
    group = pool.take(spec)
    results, failures = group.run(spec, "run", str(tmp_path / "logs"))
    assert results is None
    by_rank = {f.local_rank: f for f in failures}
    assert sorted(by_rank) == [0, 1]
    assert by_rank[1].exitcode == 3
    assert by_rank[0].exitcode == 1  # its own exit, not a stop's signal
    assert "rank 0's own error" in str(by_rank[0].message)
