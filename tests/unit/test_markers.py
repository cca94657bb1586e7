"""The suite's structure: `pytest -m "not slow"` leaves out every test of the folders that
launch processes and keeps the rest; no two test modules share a file name."""

from __future__ import annotations

from pathlib import Path

from .. import conftest


class _Item:
    def __init__(self, path: Path, *marks: str):
        self.path, self.marks = path, list(marks)

    def add_marker(self, mark):
        self.marks.append(mark.name)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_tests_that_launch_processes_are_slow_and_the_rest_is_not():
    tests = Path(conftest.__file__).parent
    items = {name: _Item(tests / name) for name in
             ("e2e/test_cli.py", "distributed/test_scopes.py", "unit/test_comparators_pool.py", "unit/test_draw.py")}
    items["one process"] = _Item(tests / "distributed/test_scopes.py", "one_process")
    conftest.pytest_collection_modifyitems(list(items.values()))
    assert {name: item.marks for name, item in items.items()} == {
        "e2e/test_cli.py": ["slow"], "distributed/test_scopes.py": ["slow"],
        "unit/test_comparators_pool.py": [], "unit/test_draw.py": [], "one process": ["one_process"]}


def test_the_markers_are_registered(pytestconfig):
    names = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert {"slow", "one_process"} <= names


def test_no_two_test_modules_share_a_file_name():
    """A file name says which module a report or `-k` means, whichever folder holds it."""
    tests = Path(conftest.__file__).parent
    folders: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        folders.setdefault(path.name, []).append(str(path.parent.relative_to(tests)))
    assert {name: where for name, where in folders.items() if len(where) > 1} == {}
