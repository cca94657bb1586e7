"""pytest plugin: the `tp_run` fixture runs a layer (or your implementation) on real ranks.

    def test_my_kernel(tp_run):
        assert tp_run(layer=LAYER, tp=4, model="tiny", impl=MyImpl).passed

Each call composes the same Hydra config the CLI uses, checks it, and launches the ranks
through the same launcher in this process (the forkserver stays warm, so later runs start in
a fraction of a second). Every run gets its own output folder under the test's tmp_path and a
free rendezvous port, so runs are safe under pytest-xdist. The result's repr is the full
report, so `assert result.passed` shows the failing tensor or rank's traceback.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest


@dataclass
class TPRunResult:
    exit_code: int
    result: dict | None  # the run's result.json (status "config-error" when the config was refused)
    report: str  # the verdict report (what the CLI prints after the run)
    output_dir: str
    output: str = ""  # everything the run printed: progress, rank 0's log, the report

    @property
    def passed(self) -> bool:
        return self.exit_code == 0

    @property
    def status(self) -> str:
        if self.result is None:
            return "config-error"
        return self.result["status"]

    def verdict(self, tensor: str) -> dict:
        return next(v for v in self.result["verdicts"] if v["tensor"] == tensor)

    def __repr__(self) -> str:
        # The report alone (no log lines), its verdict and root cause first: pytest shows the
        # start of a failing assertion's explanation.
        lines = self.report.splitlines()
        head = [ln for ln in lines if ln.startswith(("ERROR:", "VERDICT:", "error:"))]
        return f"TPRunResult(exit_code={self.exit_code}, output_dir={self.output_dir!r})\n" + "\n".join(head + lines)


def _overrides(key: str, value) -> list[str]:
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        target = [f"{key}._target_={value.__module__}.{value.__qualname__}"]
        # A class is instantiated into the callable; a function is the callable itself.
        return target if isinstance(value, type) else target + [f"+{key}._partial_=true"]
    if isinstance(value, (list, tuple)):
        return [f"{key}=[{','.join(str(v) for v in value)}]"]
    if value is None:
        return [f"{key}=null"]
    return [f"{key}={value}"]


def run_layer(output_dir: str, *, overrides: list[str] = (), pool=None, **keys) -> TPRunResult:
    """Compose `config.yaml` with `keys` (layer=..., tp=..., impl=<class>) and run it; `pool`:
    warm rank groups an earlier run left (`launcher.run.rank_group.GroupPool`; None: new ranks)."""
    import contextlib
    import io

    from hydra import compose, initialize_config_module

    from launcher.config.schema import refused_overrides
    from launcher.job import execute  # registers the schemas
    from launcher.report.console import render
    from launcher.report.exit_codes import EXIT_ERROR
    from launcher.store.snapshot_layer import with_snapshot_layer

    args = with_snapshot_layer([o for k, v in keys.items() for o in _overrides(k, v)] + list(overrides))
    refusal = refused_overrides(args)  # as the command line refuses it, before composing
    if refusal is not None:
        return TPRunResult(exit_code=EXIT_ERROR, result=None, report=f"error: {refusal}", output_dir=output_dir,
                           output=f"error: {refusal}")
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=args)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = execute(cfg, output_dir, overrides=args, pool=pool)
    path = os.path.join(output_dir, "result.json")
    result = json.load(open(path)) if os.path.exists(path) else None
    output = (out.getvalue() + err.getvalue()).strip()
    report = render(result) if result is not None else output
    return TPRunResult(exit_code=code, result=result, report=report, output_dir=output_dir, output=output)


@pytest.fixture(scope="session")
def warm_rank_groups():
    """The rank processes the session's runs share: a run of the shape an earlier one had
    reuses its ranks (as a sweep's jobs do); they leave at the session's end."""
    from launcher.run.rank_group import GroupPool

    pool = GroupPool()
    yield pool
    pool.close()


@pytest.fixture
def tp_run(request, tmp_path, warm_rank_groups):
    """Run a TP decode layer on real ranks: `tp_run(layer=LAYER, tp=2, model="tiny", impl=...)`."""
    runs: list[TPRunResult] = []
    request.node._tp_runs = runs  # shown under a failing test by pytest_runtest_makereport

    def run(*, overrides: list[str] = (), **keys) -> TPRunResult:
        result = run_layer(str(tmp_path / f"run{len(runs) + 1}"), overrides=overrides, pool=warm_rank_groups, **keys)
        runs.append(result)
        return result

    return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that used tp_run shows each run's full report (with a failing rank's
    traceback) in its failure output, not only the shortened repr of the assertion."""
    outcome = yield
    rep = outcome.get_result()
    runs = getattr(item, "_tp_runs", None)
    if rep.when == "call" and rep.failed and runs:
        for i, r in enumerate(runs, 1):
            rep.sections.append((f"tp_run {i} (exit {r.exit_code}, {r.output_dir})", r.report))
