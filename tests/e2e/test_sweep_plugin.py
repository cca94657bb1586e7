"""The harness's sweeper and launcher (`hydra_plugins.dsv4_tp_harness.harness_sweeper`), the default of
`python -m launcher -m`: the basic pair's jobs in the basic pair's order, each job's config
composed once instead of twice, a job that cannot be composed still refusing the whole sweep
before any job runs; and shown to Hydra where an editable install hides them."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import hydra_plugins
import pytest
from hydra.errors import HydraException

from launcher.cli import show_our_plugins_to_hydra
from launcher.config.sweep_jobs import expand_jobs

from ..conftest import REPO

# `python -m launcher ARGS`, counting the job configs Hydra composes (its config loader's
# load_sweep_config, of Hydra's public ConfigLoader interface: the sweeper's check of each job
# and the launcher's run of it), in whichever process composes them: one line per composition,
# "pid overrides", appended to a file. Hydra's one implementation of the interface is found as
# its subclass, loaded with Hydra.
_COUNTING = """
import json, os, sys
import hydra
from hydra.core.config_loader import ConfigLoader

record = sys.argv.pop(1)
(loader_class,) = ConfigLoader.__subclasses__()
original = loader_class.load_sweep_config

def counted(self, master_config, sweep_overrides):
    with open(record, "a") as f:
        f.write(f"{os.getpid()} {json.dumps(list(sweep_overrides))}\\n")
    return original(self, master_config, sweep_overrides)

loader_class.load_sweep_config = counted
sys.argv = ["launcher", *sys.argv[1:]]
from launcher.__main__ import run
run()
"""

# Four jobs, two choices of config groups: composed on two processes where there are two cores.
JOBS = [["layer=swa", "model=tiny", "tp=1"], ["layer=swa", "model=tiny", "tp=2"],
        ["layer=hca", "model=tiny", "tp=1"], ["layer=hca", "model=tiny", "tp=2"]]


def _sweep(tmp_path, name: str, *args: str) -> tuple[subprocess.CompletedProcess, list, dict]:
    """The sweep's process, its compositions `[(pid, overrides)]` and its summary."""
    sweep_dir, record = tmp_path / name, tmp_path / f"{name}.composed"
    p = subprocess.run([sys.executable, "-c", _COUNTING, str(record), "-m", "layer=swa,hca", "model=tiny", "tp=1,2",
                        *args, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    composed = [(int(pid), json.loads(job)) for pid, job in
                (line.split(" ", 1) for line in record.read_text().splitlines())] if record.exists() else []
    summary = json.loads((sweep_dir / "summary.json").read_text())
    return p, composed, summary


def test_each_job_is_composed_once_and_runs_as_with_the_basic_pair(tmp_path):
    ours, composed, summary = _sweep(tmp_path, "ours")
    assert ours.returncode == 0, ours.stdout + ours.stderr
    # Checked before the first job ran, not again to run it; composed once per layer, the other
    # tp set on a copy (launcher.config.sweep_compose).
    assert sorted(job for _, job in composed) == [JOBS[2], JOBS[0]]
    if len(os.sched_getaffinity(0)) >= 2:
        assert len({pid for pid, _ in composed}) == 2  # this process and one forked copy
    basic, basic_composed, basic_summary = _sweep(tmp_path, "basic", "hydra/sweeper=basic", "hydra/launcher=basic")
    assert basic.returncode == 0, basic.stdout + basic.stderr
    assert [job for _, job in basic_composed] == JOBS + JOBS  # Hydra's basic pair: once to check, once to run
    jobs = [(j["job"], j["overrides"], j["verdict"]) for j in summary["jobs"]]
    assert jobs == [(j["job"], j["overrides"], j["verdict"]) for j in basic_summary["jobs"]]
    assert [o for _, o, _ in jobs] == JOBS and {v for _, _, v in jobs} == {"PASS"}
    # The jobs' own records are Hydra's: each job's folder, its .hydra files, its number, and
    # the same config as the basic pair composed (also where it was set on a copy of another's).
    for num, job in enumerate(JOBS):
        overrides = (tmp_path / "ours" / str(num) / ".hydra" / "overrides.yaml").read_text()
        assert all(o in overrides for o in job)
        assert json.loads((tmp_path / "ours" / str(num) / "result.json").read_text())["job"]["num"] == num
        config = (tmp_path / "ours" / str(num) / ".hydra" / "config.yaml").read_text()
        assert config == (tmp_path / "basic" / str(num) / ".hydra" / "config.yaml").read_text(), num
    assert "HarnessSweeper" in (tmp_path / "ours" / "multirun.yaml").read_text()


def test_batches_are_checked_and_run_one_after_another(tmp_path):
    p, composed, summary = _sweep(tmp_path, "batches", "hydra.sweeper.max_batch_size=1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [job for _, job in composed] == JOBS and [j["overrides"] for j in summary["jobs"]] == JOBS


@pytest.mark.parametrize("jobs", [
    ["model=tiny,nosuch", "tp=1"],
    ["tp=1,2", "model=tiny,nosuch"],  # four jobs: the bad job 1 is composed before job 2 is set from job 0
])
def test_a_job_that_cannot_be_composed_refuses_the_sweep_before_any_job_runs(tmp_path, jobs):
    sweep_dir = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "launcher", "-m", "layer=swa", *jobs,
                        f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "nosuch" in p.stderr and "Traceback" not in p.stderr
    assert not (sweep_dir / "0" / "result.json").exists()  # job 0 was fine, and still did not run


@pytest.mark.parametrize("subdir, batch", [("same", []), ("${tp}", ["hydra.sweeper.max_batch_size=1"])],
                         ids=["fixed", "naming-what-no-job-varies-in-batches"])
def test_jobs_sharing_one_output_folder_refuse_the_sweep_before_one_replaces_anothers_result(tmp_path, subdir, batch):
    sweep_dir = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "launcher", "-m", "layer=swa", "model=tiny", "tp=1", "seed=1,2", *batch,
                        f"hydra.sweep.subdir={subdir}", f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    folder = sweep_dir / ("same" if subdir == "same" else "1")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"hydra.sweep.subdir={subdir} gives jobs 0 and 1 the same folder '{folder.name}'" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    if batch:  # one job a batch: job 0 ran before job 1 was composed, and its result is its own
        assert json.loads((folder / "result.json").read_text())["job"]["num"] == 0
    else:  # every job is checked before any runs
        assert not (folder / "result.json").exists()


def test_a_sweep_over_a_groups_options_is_planned_in_full(tmp_path):
    """`glob(...)` lists a config group's options through Hydra's config loader: the sweep's
    record (its planned jobs, from which a job that never ran is an ERROR row) has them too."""
    sweep_dir = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "launcher", "-m", "layer=glob(s*)", "model=tiny", "tp=1",
                        f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "sweep: 1 passed" in p.stdout, p.stdout + p.stderr
    assert json.loads((sweep_dir / "sweep.json").read_text())["jobs"] == [["layer=swa", "model=tiny", "tp=1"]]
    assert "raised" not in p.stderr  # no callback of the sweep failed
    listed = subprocess.run([sys.executable, "-m", "launcher.sweep", "list", "layer=glob(s*)", "model=tiny", "tp=1"],
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                            timeout=300)
    assert listed.returncode == 0 and "sweep: 1 jobs, 0 would be refused" in listed.stdout, listed.stdout + listed.stderr


def test_the_basic_sweepers_jobs_in_its_order():
    assert expand_jobs({"layer": "swa,csa"}, ["tp=1,2", "model=tiny"]) == [
        ["layer=swa", "tp=1", "model=tiny"], ["layer=swa", "tp=2", "model=tiny"],
        ["layer=csa", "tp=1", "model=tiny"], ["layer=csa", "tp=2", "model=tiny"]]
    # A key given twice keeps its first place and its last value.
    assert expand_jobs({"tp": "1,2"}, ["layer=hca", "tp=8"]) == [["tp=8", "layer=hca"]]
    assert expand_jobs({}, ["seed=range(1,4)"]) == [["seed=1"], ["seed=2"], ["seed=3"]]
    with pytest.raises(HydraException, match="does not support sweep type"):
        expand_jobs({}, ["seed=interval(0,1)"])


def test_where_the_namespace_hides_our_plugins_hydra_is_shown_them(monkeypatch):
    """An editable install serves `hydra_plugins.dsv4_tp_harness` through an import hook that
    Hydra's plugin walk cannot list (its folder is a placeholder on the namespace's path)."""
    hook = "__editable__.dsv4_tp_harness-0.1.0.finder.__path_hook__"
    monkeypatch.setattr(hydra_plugins, "__path__", [hook])
    assert "dsv4_tp_harness" not in {m.name for m in pkgutil.iter_modules(hydra_plugins.__path__)}
    show_our_plugins_to_hydra()
    assert "dsv4_tp_harness" in {m.name for m in pkgutil.iter_modules(hydra_plugins.__path__)}
    assert hook in hydra_plugins.__path__  # the other plugins' folders stay
    shown = list(hydra_plugins.__path__)
    show_our_plugins_to_hydra()  # already visible: nothing added twice
    assert list(hydra_plugins.__path__) == shown

