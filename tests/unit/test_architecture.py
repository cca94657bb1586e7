"""The house's floors, read off the source (docs/architecture.md): imports go one way and form
no cycle, the launcher names no layer, and no module is over 600 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from layers.registry import LAYERS, PHASES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hydra_plugins", "launcher", "layers")  # highest first
# The launcher's floors, lowest first: a module imports only from its own floor or a lower one.
LAUNCHER_FLOORS = (("launcher.config",), ("launcher.store", "launcher.verify"), ("launcher.run",),
                   ("launcher.report",), ("launcher",))
MAX_LINES = 600


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at module level or inside a function."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in names:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (empty: the graph is acyclic)."""
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return found


def _floor(module: str) -> int | None:
    for level, floors in enumerate(LAUNCHER_FLOORS):
        if any(module == f or module.startswith(f + ".") for f in floors):
            return level
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the floors: layers -> launcher or hydra_plugins, launcher -> hydra_plugins,
    a launcher floor -> a higher one."""
    bad = []
    for source, targets in graph.items():
        for target in targets:
            top_s, top_t = source.split(".")[0], target.split(".")[0]
            if PACKAGES.index(top_t) < PACKAGES.index(top_s):
                bad.append(f"{source} -> {target}")
            elif top_s == top_t == "launcher" and _floor(target) > _floor(source):
                bad.append(f"{source} -> {target}")
    return sorted(bad)


def test_imports_form_no_cycle():
    assert cycles(import_graph(_modules())) == []


def test_no_module_imports_from_a_higher_floor():
    assert upward_imports(import_graph(_modules())) == []


def test_verify_is_tensor_code_and_report_only_reads_results():
    graph = import_graph(_modules())
    verify = {t for s, ts in graph.items() if s.startswith("launcher.verify") for t in ts}
    report = {t for s, ts in graph.items() if s.startswith("launcher.report") for t in ts}
    assert {t for t in verify if t.startswith("layers.") and not t.startswith("layers.contract")} == set()
    assert {t for t in report if t.startswith(("launcher.run", "layers.")) and not t.startswith("layers.contract")} == set()
    distributed = [m for m, p in _modules().items() if m.startswith("launcher.verify")
                   for node in ast.walk(ast.parse(p.read_text()))
                   if isinstance(node, (ast.Import, ast.ImportFrom)) and "torch.distributed" in ast.unparse(node)]
    assert distributed == []


def test_the_checks_see_a_wrong_graph():
    graph = {"launcher.config.spec": {"launcher.run.worker"}, "launcher.run.worker": {"launcher.config.spec"},
             "layers.swa.layer": {"launcher.verify.base"}}
    assert cycles(graph) == [["launcher.config.spec", "launcher.run.worker", "launcher.config.spec"]]
    assert upward_imports(graph) == ["launcher.config.spec -> launcher.run.worker", "layers.swa.layer -> launcher.verify.base"]


def layer_names_in(source: str, allowed: frozenset[str] = frozenset()) -> list[str]:
    """The layer names (and phases other than decode) a source writes as string literals."""
    names = (set(LAYERS) | set(PHASES[1:])) - allowed
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and n.value in names]


def test_the_launcher_names_no_layer():
    found = {}
    for module, path in _modules().items():
        if module.startswith("launcher"):
            # verify's pool locations name a cache block, not the layer.
            allowed = frozenset({"block"}) if module.startswith("launcher.verify") else frozenset()
            names = layer_names_in(path.read_text(), allowed)
            if names:
                found[module] = names
    assert found == {}
    assert layer_names_in('if case.layer == "moe": pass') == ["moe"]


def test_the_launcher_names_no_case_class():
    sources = {m: p.read_text() for m, p in _modules().items() if m.startswith("launcher")}
    pattern = re.compile(r"\b(MoECase|BlockCase|PrefillCase)\b")
    assert {m: pattern.findall(s) for m, s in sources.items() if pattern.search(s)} == {}


@pytest.mark.parametrize("folder", ["hydra_plugins", "launcher", "layers", "scripts", "tests"])
def test_no_module_is_over_600_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
