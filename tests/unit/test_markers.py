"""The fast subset: `pytest -m "not slow"` leaves out every test of the folders that launch
processes, and keeps the rest."""

from __future__ import annotations

from pathlib import Path

from .. import conftest


class _Item:
    def __init__(self, path: Path):
        self.path, self.marks = path, []

    def add_marker(self, mark):
        self.marks.append(mark.name)


def test_tests_that_launch_processes_are_slow_and_the_rest_is_not():
    tests = Path(conftest.__file__).parent
    items = {name: _Item(tests / name) for name in
             ("e2e/test_cli.py", "distributed/test_scopes.py", "unit/test_comparators.py", "unit/test_draw.py")}
    conftest.pytest_collection_modifyitems(list(items.values()))
    assert {name: item.marks for name, item in items.items()} == {
        "e2e/test_cli.py": ["slow"], "distributed/test_scopes.py": ["slow"],
        "unit/test_comparators.py": [], "unit/test_draw.py": []}


def test_the_slow_marker_is_registered(pytestconfig):
    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
