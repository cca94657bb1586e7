"""The README and docs/ in one process: every command is one a test can check, names what the
project ships (extras, CI packages, links), and composes into a config the launcher accepts.
tests/e2e/test_doc_commands.py runs them."""

from __future__ import annotations

import os
import re
import tomllib

import pytest
import yaml
from omegaconf import OmegaConf

from launcher.config.spec import validated_spec
from launcher.run.preflight import preflight
from launcher.sweep import planned
from launcher.sweep_config import print_sweep_configs

from ..conftest import REPO, compose_config
from ..doc_commands import DOC_FILES, Command, all_commands, classify

COMMANDS = all_commands()
README_MAX_LINES = 400


def _launcher_commands() -> list[Command]:
    return [c for c in COMMANDS if c.kind in ("run", "compose") and c.launcher_args() is not None]


def test_every_command_is_one_a_test_can_check():
    assert len(COMMANDS) > 40
    unknown = [f"{c.source}: {c.text}" for c in COMMANDS if c.kind == "unknown"]
    assert not unknown
    # The classifier itself: flash dims and clusters are composed, tiny runs run.
    assert classify("python -m launcher layer=csa tp=8") == "compose"
    assert classify("srun --nodes=2 python -m launcher layer=swa model=tiny nnodes=2") == "compose"
    assert classify("python -m launcher layer=swa tp=2 model=tiny") == "run"
    assert classify("xdg-open report.html") == "unknown"


def test_the_readme_is_a_guide_and_its_set_up_is_two_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < README_MAX_LINES
    setup = [c for c in COMMANDS if c.source.startswith("README.md") and c.kind in ("install", "pytest", "compose")][:4]
    assert [c.kind for c in setup] == ["install", "compose", "install", "pytest"]


def test_pip_installs_name_the_projects_extras():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = [c for c in COMMANDS if c.kind == "install"]
    assert installs
    for c in installs:
        targets = [a for a in c.argv[2:] if a.startswith(".")]
        assert targets, f"{c.source}: installs nothing of this project"
        for t in targets:
            named = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", t)
            assert named, f"{c.source}: {t}"
            assert set(filter(None, (named.group(1) or "").split(","))) <= extras, f"{c.source}: {t}"


def test_apt_installs_are_the_packages_ci_installs():
    ci = (REPO / ".ci" / "run").read_text()
    for c in (c for c in COMMANDS if c.kind == "system"):
        for pkg in (a for a in c.argv[2:] if not a.startswith("-")):
            assert re.search(rf"apt-get install .*\b{re.escape(pkg)}\b", ci), f"{c.source}: {pkg}"


_LINK = re.compile(r"\]\(([^)#\s]+)?(?:#([^)\s]+))?\)")


def _anchors(path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_every_link_of_a_doc_resolves(doc):
    for target, anchor in _LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: {target}"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: {target}#{anchor}"


def _is_hydra(arg: str) -> bool:
    return arg.lstrip("+~").startswith(("hydra.", "hydra/"))


@pytest.mark.parametrize("cmd", _launcher_commands(), ids=lambda c: c.source)
def test_every_launcher_command_composes_and_is_accepted(cmd, capsys):
    args = [a for a in cmd.launcher_args() if a not in ("--cfg", "-c", "job", "hydra", "all")]
    if "--help" in args:
        return
    sweep = "-m" in args
    args = [a for a in args if a != "-m"]
    cluster = cmd.kind == "compose" and not any("my_kernels." in a for a in args) and not any(
        a.startswith("model=") for a in args) and any(a.startswith(("nnodes=", "hydra/")) for a in args)
    if sweep and any(a.startswith(("hydra/", "hydra.launcher.")) for a in args):
        # What `-m ... --cfg hydra` prints: every job's Hydra node carries the chosen launcher's keys.
        assert print_sweep_configs(["-m", *args, "--cfg", "hydra"]) is None
        for job in capsys.readouterr().out.split("# job ")[1:]:
            shown = OmegaConf.create(yaml.safe_load(job.split("\n", 1)[1]))
            for a in (a for a in args if a.startswith("hydra.")):
                key, value = a.split("=", 1)
                assert str(OmegaConf.select(shown, key)) == value, (cmd.source, key)
    jobs = planned(args) if sweep else [[a for a in args if not _is_hydra(a)]]
    assert jobs, cmd.source
    # A sweep's first job stands for the rest (`launcher.sweep list` checks every one, and the e2e
    # test composes or runs them all); a listing that must refuse one is checked whole.
    listing = "launcher.sweep list" in cmd.text
    refused = []
    for job in jobs if listing else jobs[:1]:
        cfg = compose_config(*job)
        if any(a.startswith("golden_data=") for a in job):
            continue  # the snapshot an earlier command writes: the e2e test replays it
        try:
            if cluster or cmd.argv[0] == "srun" or any("my_kernels." in a for a in job):
                validated_spec(cfg, os.devnull, overrides=job)  # no other node, no such module here
            else:
                preflight(cfg, output_dir=os.devnull, overrides=job)
        except Exception as e:  # noqa: BLE001 - a refusal of any kind is what is asserted on
            refused.append(f"{' '.join(job)}: {e}")
    if listing and cmd.expected == 2:
        assert refused, cmd.source
    else:
        assert not refused, (cmd.source, refused)
