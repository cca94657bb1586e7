"""pytest plugin: the `tp_run` fixture runs a layer (or your implementation) on real ranks.

    def test_my_kernel(tp_run):
        assert tp_run(layer="csa", tp=4, model="tiny", impl=MyImpl).passed

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
    report: str
    output_dir: str

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
        return f"TPRunResult(exit_code={self.exit_code}, output_dir={self.output_dir!r})\n{self.report}"


def _override(key: str, value) -> str:
    if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
        value = f"{value.__module__}.{value.__qualname__}"
        return f"{key}._target_={value}"
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    if value is None:
        return f"{key}=null"
    return f"{key}={value}"


def run_layer(output_dir: str, *, overrides: list[str] = (), **keys) -> TPRunResult:
    """Compose `config.yaml` with `keys` (layer=..., tp=..., impl=<class>) and run it."""
    import contextlib
    import io

    from hydra import compose, initialize_config_module

    from .cli import execute  # registers the schemas

    args = [_override(k, v) for k, v in keys.items()] + list(overrides)
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=args)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = execute(cfg, output_dir)
    path = os.path.join(output_dir, "result.json")
    result = json.load(open(path)) if os.path.exists(path) else None
    return TPRunResult(exit_code=code, result=result, report=(out.getvalue() + err.getvalue()).strip(), output_dir=output_dir)


@pytest.fixture
def tp_run(tmp_path):
    """Run a TP decode layer on real ranks: `tp_run(layer="swa", tp=2, model="tiny", impl=...)`."""
    count = 0

    def run(*, overrides: list[str] = (), **keys) -> TPRunResult:
        nonlocal count
        count += 1
        return run_layer(str(tmp_path / f"run{count}"), overrides=overrides, **keys)

    return run
