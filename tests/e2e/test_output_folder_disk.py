"""An output folder that cannot take a run's files is an error (exit 2) said in one line: never
Hydra's traceback, never the FAIL status, never a PASS whose result.json was not written.

Full and read-only disks are tiny tmpfs mounts (`tests.tmpfs`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from launcher.pytest_plugin import run_layer
from tests.conftest import REPO
from tests.tmpfs import tmpfs

SWA = ["layer=swa", "tp=2", "model=tiny", "golden_cache=null"]


def run_cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("disk, why", [
    (dict(fill=True), "cannot be written (No space left on device)"),
    (dict(fill=True, read_only=True), "cannot be written (Read-only file system)"),
    (dict(), "has {free} bytes free on its disk"),  # room for Hydra's config copies, not for a run
])
def test_a_full_or_read_only_output_folder_is_refused_with_exit_2(tmp_path, disk, why):
    with tmpfs(tmp_path / "disk", size="64k", **disk) as mount:
        p = run_cli([*SWA, f"hydra.run.dir={mount}/out"], tmp_path)
        assert p.returncode == 2, p.stdout + p.stderr
        why = why.format(free=shutil.disk_usage(mount).free)  # what is free once the folder's lock is written
        assert f"error: hydra.run.dir: {mount}/out" in p.stderr and why in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_a_sweep_folder_on_a_full_disk_is_refused_with_exit_2(tmp_path):
    with tmpfs(tmp_path / "disk", size="64k", fill=True) as mount:
        p = run_cli(["-m", *SWA, "seed=1,2", f"hydra.sweep.dir={mount}/sweep"], tmp_path)
        assert p.returncode == 2 and "error: hydra.sweep.dir:" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_disk_that_fills_during_the_run_is_an_error_not_a_crash(tmp_path):
    with tmpfs(tmp_path / "disk", size="16k") as mount:
        run = run_layer(str(mount / "out"), layer="swa", tp=2, model="tiny", golden_cache=None)
        assert run.exit_code == 2, run
        assert f"error: output folder {mount}/out: " in run.output and "cannot be written" in run.output
        assert not list((mount / "out").glob("*.tmp"))
