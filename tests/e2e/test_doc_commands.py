"""Every command of the README and docs/ as a user types it: run as written where it runs on
this machine in minutes (tiny dims, a snapshot made just before, the housekeeping tools), else its
config composed through the CLI with `--cfg`; the README's test commands collected. Each doc's
commands run in order in one folder of their own, so a command may use what an earlier one wrote
(`save_data=snap/x`, then `golden_data=snap/x`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..conftest import REPO
from ..doc_commands import DOC_FILES, cfg_flag, doc_commands

pytestmark = pytest.mark.timeout(1800)


def _env() -> dict:
    # `python` of the docs is this interpreter; `tests.defects` imports from the checkout.
    bindir = os.path.dirname(sys.executable)
    return dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def _shell(line: str, cwd, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("doc", [p for p in DOC_FILES if doc_commands(p)], ids=lambda p: p.name)
def test_every_command_of_the_doc_runs_or_composes(doc, tmp_path):
    # The docs' commands are typed in a checkout: its shipped data (tests/data) is linked into
    # the folder they run in, which keeps what they write out of the repository.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(REPO / "tests" / "data")
    for cmd in doc_commands(doc):
        where = f"{cmd.source}: {cmd.text}"
        if cmd.kind in ("install", "system"):
            continue  # checked against pyproject and CI in tests/unit/test_doc_commands_compose.py
        if cmd.kind == "pytest":
            # Collected in the checkout (every marker and path it names must select tests), not run.
            p = subprocess.run([sys.executable, *cmd.argv[1:], "--collect-only", "-p", "no:cacheprovider"],
                               cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
            assert p.returncode == 0 and "tests/" in p.stdout, (where, p.stdout[-2000:], p.stderr[-2000:])
        elif cmd.kind == "script":
            # A measurement takes minutes: its script must exist and know every option the doc gives it.
            p = subprocess.run([sys.executable, cmd.argv[1], "--help"], cwd=REPO, env=_env(), capture_output=True,
                               text=True, timeout=300)
            unknown = [a for a in cmd.argv[2:] if a.startswith("--") and a.split("=")[0] not in p.stdout]
            assert p.returncode == 0 and not unknown, (where, unknown, p.stdout[-2000:], p.stderr[-2000:])
        elif cmd.kind == "run":
            p = _shell(cmd.text, tmp_path)
            assert p.returncode == cmd.expected, (where, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
        else:
            assert cmd.kind == "compose", f"{where}: no test can check this command (tests/doc_commands.py)"
            args = cmd.launcher_args()
            p = subprocess.run([sys.executable, "-m", "launcher", *args, *cfg_flag(args)], cwd=tmp_path, env=_env(),
                               capture_output=True, text=True, timeout=600)
            assert p.returncode == 0 and p.stdout.strip(), (where, p.stdout[-2000:], p.stderr[-2000:])
