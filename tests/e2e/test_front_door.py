"""The command line's front door, before any rank runs: what only prints or refuses imports
neither torch nor the layers; a key the run config does not have is refused, with the nearest
one; Hydra's schema nodes are never offered; a refused run leaves no output folder; a snapshot
folder whose names the file system cannot hold is refused before launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launcher.report.exit_codes import EXIT_ERROR

from ..conftest import REPO, run_cli

# What a command that starts no rank must not import: torch, and a layer's compute module.
HEAVY = ("torch", "layers.csa.layer")


# `python -m MODULE` with every module this process imports logged on stderr. An audit hook,
# not `-X importtime`: the flag is handed on to child interpreters, and a run's forkserver, started
# early so that its torch import overlaps the composition and ended at a refusal, would then show
# its imports as the launcher's, depending on how far it got before it was ended.
_LOGGED_MAIN = """
import runpy, sys
def log(event, args):
    if event == "import":
        sys.stderr.write("import: " + args[0] + chr(10))
sys.addaudithook(log)
runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
"""


def _launcher(args: list[str], cwd, env: dict | None = None, module: str = "launcher") -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in a fresh interpreter, the modules it imports logged on stderr."""
    return subprocess.run([sys.executable, "-c", _LOGGED_MAIN, module, *args], cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})),
                          capture_output=True, text=True, timeout=120)


def _imported(stderr: str) -> set[str]:
    return {ln.split(":", 1)[1].strip() for ln in stderr.splitlines() if ln.startswith("import: ")}


def _said(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("import: ")]


@pytest.mark.parametrize("args, env, code", [
    (["--help"], None, 0),
    (["--cfg", "job", "layer=csa", "tp=4"], None, 0),
    (["-m", "tp=1,2", "--cfg", "job"], None, 0),
    (["-sc", "query=bash"], {"COMP_LINE": "dsv4-tp-harness model="}, 0),
    (["+layr=swa"], None, EXIT_ERROR),
    (["tpp=2"], None, EXIT_ERROR),
    (["tp=abc"], None, EXIT_ERROR),
    (["model=huge"], None, EXIT_ERROR),
    (["layer=csa", "tp=3"], None, EXIT_ERROR),
    (["layer=moe", "ep=99"], None, EXIT_ERROR),
    (["layer=moe", "scope=output"], None, EXIT_ERROR),
    (["phase=prefill", "layer=moe"], None, EXIT_ERROR),
], ids=["help", "cfg", "sweep-cfg", "completion", "plus-typo", "typo", "bad-value", "bad-option", "tp-rule", "ep-rule",
        "scope-rule", "phase-rule"])
def test_what_only_prints_or_refuses_never_imports_torch(tmp_path, args, env, code):
    p = _launcher(args, tmp_path, env)
    assert p.returncode == code, p.stdout + "\n".join(_said(p.stderr))
    assert not _imported(p.stderr) & set(HEAVY), "\n".join(_said(p.stderr))
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_compare_reads_results_without_importing_torch(tmp_path):
    # compare reads result.json files: it has nothing to compute with torch or a layer.
    run = run_cli(["layer=swa", "tp=2", "model=tiny", "golden_cache=null"], tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    p = _launcher([str(tmp_path / "out"), str(tmp_path / "out")], tmp_path, module="launcher.compare")
    assert p.returncode == 0 and "1 matched, 0 regressed" in p.stdout, p.stdout + "\n".join(_said(p.stderr))
    assert not _imported(p.stderr) & set(HEAVY), sorted(_imported(p.stderr) & set(HEAVY))


@pytest.mark.parametrize("args, code, said", [
    (["--help"], 0, "usage: python -m launcher.sweep"),
    (["rerun", "SWEEP", "--list"], 0, "job 1 FAIL: layer=csa tp=2"),
    (["rerun", "nowhere"], EXIT_ERROR, "is not a sweep folder"),
    (["list", "layer=swa,hca", "tp=1,3", "model=tiny"], EXIT_ERROR, "job 3 refused: tp=3 must divide o_groups=8"),
    (["list", "+sweep=smoke"], 0, "sweep: 6 jobs, 0 would be refused"),
], ids=["help", "rerun-list", "rerun-refused", "list-refused", "list"])
def test_sweep_housekeeping_that_runs_no_job_never_imports_torch(tmp_path, args, code, said):
    # help and a rerun's own work read files; `list` checks each job's keys and case rules.
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "summary.json").write_text('{"jobs": [{"job": 0, "verdict": "PASS", "overrides": ["layer=swa"]},'
                                        ' {"job": 1, "verdict": "FAIL", "overrides": ["layer=csa", "tp=2"]}]}')
    p = _launcher([str(sweep) if a == "SWEEP" else a for a in args], tmp_path, module="launcher.sweep")
    assert p.returncode == code and said in p.stdout + p.stderr, p.stdout + "\n".join(_said(p.stderr))
    assert not _imported(p.stderr) & set(HEAVY), sorted(_imported(p.stderr) & set(HEAVY))


def test_help_is_the_page_hydra_prints(tmp_path):
    # --help composes once and prints the template; with --resolve Hydra prints it itself.
    ours, hydras = _launcher(["--help"], tmp_path), _launcher(["--help", "--resolve"], tmp_path)
    assert ours.returncode == hydras.returncode == 0, _said(ours.stderr) + _said(hydras.stderr)
    assert "Exit status:" in ours.stdout and ours.stdout == hydras.stdout


@pytest.mark.parametrize("args, nearest", [
    (["+layr=swa"], "layer"),
    (["+lauer=csa"], "layer"),
    (["++tpp=2"], "tp"),
    (["tpp=2"], "tp"),
    (["-m", "+layr=swa,csa"], "layer"),
])
def test_an_unknown_top_level_key_is_refused_even_with_plus(tmp_path, args, nearest):
    p = _launcher(args + ["model=tiny"], tmp_path)
    said = _said(p.stderr)
    assert p.returncode == EXIT_ERROR and len(said) == 1, p.stdout + "\n".join(said)
    assert said[0].startswith("error: ") and f"did you mean {nearest!r}" in said[0], said
    assert os.listdir(tmp_path) == []  # nothing ran, no folder


def test_sweep_list_refuses_an_unknown_key_too(tmp_path):
    p = _launcher(["list", "+lauer=csa", "tp=1,2"], tmp_path, module="launcher.sweep")
    assert p.returncode == EXIT_ERROR and "did you mean 'layer'" in p.stderr, p.stdout + p.stderr


@pytest.mark.parametrize("group", ["model", "layer"])
def test_completion_never_offers_a_schema_node(tmp_path, group):
    p = _launcher(["-sc", "query=bash"], tmp_path, {"COMP_LINE": f"dsv4-tp-harness {group}="})
    options = p.stdout.split()
    assert p.returncode == 0 and f"{group}={dict(model='tiny', layer='swa')[group]}" in options, p.stdout + p.stderr
    assert not [o for o in options if "schema" in o], options


@pytest.mark.parametrize("option", ["model=model_schema", "layer=layer_schema"])
def test_a_schema_node_named_as_an_option_is_one_error_line(tmp_path, option):
    p = run_cli([option], tmp_path, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == EXIT_ERROR and len(lines) == 1 and "Could not find" in lines[0], p.stdout + p.stderr
    assert "schema" not in lines[0].split("Available options")[1], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [
    ["tp=3", "model=tiny"],  # refused by the preflight (the layer's rule)
    ["model=tiny", "impl=nowhere.Impl"],
    ["+layr=swa"],
    ["tp=abc"],
])
def test_a_refused_run_creates_no_output_folder(tmp_path, args):
    p = subprocess.run([sys.executable, "-m", "launcher", *args], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == EXIT_ERROR and len(lines) == 1 and lines[0].startswith("error: "), p.stdout + p.stderr
    assert os.listdir(tmp_path) == []  # no outputs/<date>/<time>/


def test_a_save_data_name_the_file_system_cannot_hold_is_refused_before_launch(tmp_path):
    name = "s" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 10)  # fits; the sibling it is built in does not
    p = run_cli(["layer=swa", "tp=2", "model=tiny", f"save_data={tmp_path / name}"], tmp_path, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == EXIT_ERROR and len(lines) == 1, p.stdout + p.stderr
    assert lines[0].startswith(f"error: save_data={tmp_path / name}: the snapshot would write the name"), lines
    assert not (tmp_path / "out").exists() and not (tmp_path / name).exists()  # nothing ran
