"""Parallel jobs on one node: job slots, their share of the cores and devices, and the ranks
confined to them.

The slot rules are checked as pure functions; the claims with real processes holding (and
dying with) the locks; the whole with real sweeps: joblib running two jobs at once puts their
ranks on disjoint cores with the right verdicts, a sequential sweep's job keeps every core.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from layers.contract.config import ConfigError

from launcher.config.job_slot import job_slot, slot_count
from launcher.config.spec import run_spec
from launcher.report.result import EXIT_FAIL
from launcher.run import devices, slots

from ..conftest import REPO, compose_config, multirun

JOBLIB = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}
SEQUENTIAL = {"_target_": "hydra_plugins.dsv4_tp_harness.harness_sweeper.HarnessLauncher"}  # the default: one job at a time


# -- how many slots, and what each one holds ---------------------------------------------------


def test_only_a_parallel_launcher_shares_the_node():
    assert slot_count(SEQUENTIAL, planned_jobs=8, n_cpus=64, n_devices=8) == 1
    assert slot_count({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"},
                      8, 64, 8) == 1
    assert slot_count(JOBLIB, planned_jobs=8, n_cpus=64, n_devices=None) == 2
    assert slot_count({**JOBLIB, "n_jobs": None}, 8, 64, None) == 1  # joblib's None is one job at a time


def test_slot_count_follows_n_jobs_within_the_sweep_the_cores_and_the_devices():
    assert slot_count({**JOBLIB, "n_jobs": 4}, planned_jobs=12, n_cpus=64, n_devices=8) == 4
    assert slot_count({**JOBLIB, "n_jobs": -1}, planned_jobs=None, n_cpus=64, n_devices=None) == 64  # -1: every core
    assert slot_count({**JOBLIB, "n_jobs": -2}, planned_jobs=None, n_cpus=64, n_devices=None) == 63
    assert slot_count({**JOBLIB, "n_jobs": -1}, planned_jobs=3, n_cpus=64, n_devices=None) == 3  # never idle slots
    assert slot_count({**JOBLIB, "n_jobs": 8}, planned_jobs=8, n_cpus=2, n_devices=None) == 2  # a core each at least
    assert slot_count({**JOBLIB, "n_jobs": 16}, planned_jobs=16, n_cpus=64, n_devices=8) == 8  # a device each


def test_a_big_node_gives_each_of_four_jobs_16_cores_and_2_gpus():
    gpus = [str(i) for i in range(8)]
    slots_ = [job_slot(k, 4, list(range(64)), gpus, "CUDA_VISIBLE_DEVICES") for k in range(4)]
    assert [len(s.cpus) for s in slots_] == [16] * 4 and [len(s.devices) for s in slots_] == [2] * 4
    assert sorted(c for s in slots_ for c in s.cpus) == list(range(64))  # disjoint, every core used
    assert [s.devices for s in slots_] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert slots_[1].describe() == "job slot 1 of 4: cores " + ",".join(map(str, range(16, 32))) + \
        ", CUDA_VISIBLE_DEVICES=2,3"


def test_slices_are_equal_whichever_slot_a_job_draws():
    # 6 cores, 4 slots: one core each (two idle), so no job runs with more threads than another.
    assert [job_slot(k, 4, [9, 2, 5, 7, 11, 3]).cpus for k in range(4)] == [(2,), (3,), (5,), (7,)]
    # The ids the visibility variable already names are sliced as they are.
    assert job_slot(1, 2, [0, 1], ["GPU-a", "GPU-b", "GPU-c"], "CUDA_VISIBLE_DEVICES").devices == ("GPU-b",)
    assert job_slot(0, 2, [0, 1]).devices is None


def test_threads_per_rank_come_from_the_slot(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    spec = run_spec(compose_config("tp=8"), "/x")
    assert spec.threads() == 8  # the whole node
    assert dataclasses.replace(spec, slot=job_slot(0, 4, list(range(64)))).threads() == 2  # 16 cores / 8 ranks


def test_a_slot_with_fewer_devices_than_ranks_is_refused_naming_the_slot():
    slot = job_slot(1, 4, list(range(64)), [str(i) for i in range(4)], "CUDA_VISIBLE_DEVICES")
    with pytest.raises(ConfigError, match=r"2 ranks per node need 2 cuda devices but 1 are in this job's slot "
                                          r"\(job slot 1 of 4: .*CUDA_VISIBLE_DEVICES=1\); lower tp or hydra.launcher.n_jobs"):
        devices.check_devices("nccl", 2, slot)
    devices.check_devices("nccl", 1, slot)


def test_the_node_devices_are_the_ones_the_visibility_variable_lists(monkeypatch):
    monkeypatch.setattr(devices, "resolve_backend", lambda requested: "nccl")
    monkeypatch.setattr(devices, "device_count", lambda backend: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5, 6,7")
    assert devices.node_devices() == ("CUDA_VISIBLE_DEVICES", ["4", "5", "6", "7"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert devices.node_devices() == ("CUDA_VISIBLE_DEVICES", [str(i) for i in range(8)])
    monkeypatch.setattr(devices, "resolve_backend", lambda requested: "gloo")
    assert devices.node_devices() == (None, None)


def test_a_rank_enters_its_slot():
    # In a fresh process, as a rank forked from the forkserver is: its cores and its devices.
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import json, os
        from launcher.config.job_slot import JobSlot
        from launcher.run import devices
        devices.enter_job_slot(JobSlot(0, 1, ({cpu},), ("3",), "CUDA_VISIBLE_DEVICES"))
        print(json.dumps([devices.cpu_affinity(), os.environ["CUDA_VISIBLE_DEVICES"]]))
    """)
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [[cpu], "3"]


# -- claiming a slot ---------------------------------------------------------------------------


def _holder(sweep_dir, count: int, job_num: int) -> tuple[subprocess.Popen, int]:
    """Another process that claims a slot and holds it until its stdin closes; its slot."""
    code = textwrap.dedent(f"""
        import sys
        from launcher.run import slots
        with slots.claim({str(sweep_dir)!r}, {count}, {job_num}) as index:
            print(index, flush=True)
            sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def test_a_job_takes_its_own_slot_or_the_next_free_one(tmp_path):
    with slots.claim(str(tmp_path), 2, job_num=3) as index:
        assert index == 1  # job number mod slot count: the sweep's order, not the timing
    holder, held = _holder(tmp_path, 2, job_num=0)
    try:
        assert held == 0
        with slots.claim(str(tmp_path), 2, job_num=0) as index:
            assert index == 1  # slot 0 is held by a live process
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    with slots.claim(str(tmp_path), 2, job_num=0) as index:
        assert index == 0  # released when its job ended


def test_a_dead_jobs_slot_is_free_again(tmp_path):
    holder, held = _holder(tmp_path, 1, job_num=0)
    holder.send_signal(signal.SIGKILL)  # as the OOM killer would end a job: nothing released it
    holder.wait(timeout=60)
    assert os.path.isfile(slots.lock_path(str(tmp_path), held))  # its lock file stays behind
    with slots.claim(str(tmp_path), 1, job_num=0) as index:
        assert index == held


def test_a_slot_is_released_when_its_job_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with slots.claim(str(tmp_path), 1, job_num=0):
            raise RuntimeError("the job failed")
    holder, held = _holder(tmp_path, 1, job_num=0)  # another process gets it straight away
    holder.stdin.close()
    holder.wait(timeout=60)
    assert held == 0


def test_with_every_slot_held_a_job_waits_for_one(tmp_path):
    holder, _ = _holder(tmp_path, 1, job_num=0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(_claim_once(tmp_path)))
    waiter.start()
    try:
        waiter.join(timeout=1)
        assert waiter.is_alive() and not got  # still waiting while the slot is held
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    waiter.join(timeout=120)
    assert got == [0]


def _claim_once(sweep_dir) -> int:
    with slots.claim(str(sweep_dir), 1, job_num=1) as index:
        return index


# -- real sweeps -------------------------------------------------------------------------------


def _results(summary: dict) -> list[dict]:
    return [json.load(open(os.path.join(j["output_dir"], "result.json"))) for j in summary["jobs"]]


def test_two_jobs_at_once_run_on_disjoint_cores_with_the_right_verdicts(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two job slots need two usable cores")
    p, summary, _ = multirun(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "layer=swa",
                             "model=tiny", "tp=2", "impl._target_=layers.tp.TorchTP,tests.defects.PerturbRankTokens")
    assert p.returncode == EXIT_FAIL, p.stdout + p.stderr
    assert [j["verdict"] for j in summary["jobs"]] == ["PASS", "FAIL"], summary
    first, second = _results(summary)
    assert (first["job_slot"]["index"], second["job_slot"]["index"]) == (0, 1)
    for r in (first, second):
        assert r["rank_cpus"] == [r["job_slot"]["cpus"]] * 2  # every rank confined to its job's slot
        assert r["threads_per_rank"] == max(1, len(r["job_slot"]["cpus"]) // 2)
    cores = [{c for cpus in r["rank_cpus"] for c in cpus} for r in (first, second)]
    assert cores[0] and cores[1] and not cores[0] & cores[1], cores


def test_a_sequential_sweeps_job_keeps_every_core(tmp_path):
    p, summary, _ = multirun(tmp_path, "layer=swa", "model=tiny", "tp=2", "seed=1,2")
    assert p.returncode == 0, p.stdout + p.stderr
    every_core = sorted(os.sched_getaffinity(0))
    for r in _results(summary):
        assert r["job_slot"] is None
        assert r["rank_cpus"] == [every_core] * 2
        assert r["threads_per_rank"] == max(1, len(every_core) // 2)
