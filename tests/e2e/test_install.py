"""The installed package (not the checkout) runs from any folder: configs and the Hydra plugins
ship inside it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..conftest import REPO


_WHERE = """
import importlib.metadata, json, launcher, configs
url = json.loads(importlib.metadata.distribution("dsv4-tp-harness").read_text("direct_url.json") or "{}")
if url.get("dir_info", {}).get("editable"):
    print("editable")
print(launcher.__file__)
print(configs.__file__)
"""


def test_installed_package_runs_outside_the_source_tree(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([sys.executable, "-c", _WHERE], cwd=tmp_path, env=env, capture_output=True, text=True)
    if where.returncode != 0:
        pytest.skip("the package is not installed in this environment (only the checkout is importable)")
    if where.stdout.startswith("editable"):
        pytest.skip("an editable install imports the checkout by design (CI installs a copy)")
    # Imported from the installed copy, not from the checkout's own folders.
    assert all(not line.startswith(str(REPO / name)) for line, name in zip(where.stdout.splitlines(), ("launcher", "configs"))), where.stdout
    p = subprocess.run([sys.executable, "-m", "launcher", "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
                        f"hydra.run.dir={tmp_path}/out"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "VERDICT: PASS" in p.stdout, p.stdout + p.stderr
    assert "PASS" in (tmp_path / "out" / "report.html").read_text()  # the page comes with the installed package
    # A sweep finds the harness's own Hydra sweeper and launcher in the installed package.
    p = subprocess.run([sys.executable, "-m", "launcher", "-m", "layer=swa", "tp=1,2", "model=tiny", "golden_cache=null",
                        f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "sweep: 2 passed" in p.stdout, p.stdout + p.stderr
    assert "HarnessSweeper" in (tmp_path / "sweep" / "multirun.yaml").read_text() and "warning" not in p.stderr
