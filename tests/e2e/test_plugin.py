"""The `tp_run` fixture as a user sees it: from their own test file, under pytest-xdist."""

from __future__ import annotations

import os

import pytest

from ..conftest import REPO

pytest_plugins = ["pytester"]

USER_TESTS = '''
import torch
from layers.tp import TorchTP


class MyImpl(TorchTP):
    pass


class Exploding(TorchTP):
    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            raise RuntimeError("my kernel exploded on rank one")
        return super().__call__(ctx, tensors)


def test_my_kernel(tp_run):
    assert tp_run(layer="swa", tp=2, model="tiny", impl=MyImpl).passed


def test_my_other_kernel(tp_run):
    assert tp_run(layer="hca", tp=2, model="tiny", impl=MyImpl).passed


def test_exploding_kernel(tp_run):
    assert tp_run(layer="swa", tp=2, model="tiny", impl=Exploding).passed
'''


@pytest.mark.timeout(300)
def test_users_tests_run_under_xdist_and_show_the_failing_ranks_traceback(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    if not os.environ.get("PYTHONPATH", "").startswith(str(REPO)):
        os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    plugin = [] if _installed() else ["-p", "launcher.pytest_plugin"]
    result = pytester.runpytest_subprocess(*plugin, "-n", "2", "-p", "no:cacheprovider", "-o", "addopts=")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "RuntimeError: my kernel exploded on rank one" in out
    assert "ERROR: rank 1 failed in phase 'layer'" in out


def _installed() -> bool:
    import importlib.metadata

    return any(ep.value == "launcher.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
