"""Shared test helpers: repo paths, the reference snapshots, and the CLI as a subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from launcher.run.forkserver import set_cpu_env

# Before any GEMM of this process: goldens here must reproduce the reference snapshots bitwise.
set_cpu_env()


def _share_the_cores() -> None:
    """Each xdist worker takes its share of the cores for torch's intra-op threads. With every
    worker on every core, torch's threads outnumber the cores and spin at each small op's
    barrier: on 2 loaded cores the in-process prefill cases took 6 to 8 times as long. A test
    that needs a thread count (the reference snapshots' two) sets it itself (`two_threads`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


_share_the_cores()

# The tests' goldens go to a folder of their own (one per test process, removed at its end),
# never into the user's cache; every run started from here, CLI subprocesses included, inherits it.
_GOLDEN_CACHE = tempfile.TemporaryDirectory(prefix="dsv4-tests-golden-")
os.environ["DSV4_TP_GOLDEN_CACHE"] = _GOLDEN_CACHE.name

REPO = Path(__file__).resolve().parents[1]
# Reference snapshots made by the reference itself and shipped here (tests/data/reference/README.md).
REFERENCE_DATA = REPO / "tests" / "data" / "reference"

# The plugin is registered by the installed package's entry point; from a bare checkout
# (nothing installed) load it here instead.
if not any(ep.value == "launcher.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
    pytest_plugins = ["launcher.pytest_plugin"]


# The tests of these folders launch processes (the CLI, gloo ranks): the fast subset,
# `pytest -m "not slow"`, leaves them out, but for a test marked `one_process` (a comparator,
# fixture or stage test beside the launches); a unit test that launches carries `slow` itself.
_SLOW_FOLDERS = ("e2e", "distributed")


def pytest_collection_modifyitems(items):
    tests = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(tests).parts if item.path.is_relative_to(tests) else ()
        if parts and parts[0] in _SLOW_FOLDERS and item.get_closest_marker("one_process") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def two_threads():
    """Torch's threads as the reference snapshots were made with: MKL splits its fp32 GEMMs by them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def reference_snapshot(layer: str) -> Path:
    """The shipped reference snapshot of a layer: swa, csa, hca at tp=2, local_t=32, model=mini;
    moe at ep=2, layer_id=4, num_tokens=96, model=tiny; prefill-swa, prefill-hca, prefill-csa at cp=2 (the
    canonical zigzag case), model=mini."""
    if layer.startswith("prefill-"):
        return REFERENCE_DATA / f"{layer}-cp2-mini"
    return REFERENCE_DATA / ("moe-ep2-tiny" if layer == "moe" else f"{layer}-tp2-mini")


def run_cli(args: list[str], cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m launcher ARGS` in a fresh interpreter, importing this checkout."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args, f"hydra.run.dir={cwd}/out"],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def multirun(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict, ET.Element]:
    sweep_dir = tmp_path / "sweep"
    p = subprocess.run(
        [sys.executable, "-m", "launcher", "-m", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})), capture_output=True, text=True,
        timeout=300,
    )
    assert (sweep_dir / "summary.json").is_file(), p.stdout + p.stderr
    summary = json.loads((sweep_dir / "summary.json").read_text())
    junit = ET.parse(sweep_dir / "junit.xml").getroot()
    return p, summary, junit


def compose_config(*overrides: str):
    """The config `python -m launcher OVERRIDES` composes (no hydra node)."""
    with initialize_config_module(config_module="configs", version_base=None):
        return compose(config_name="config", overrides=list(overrides))
