"""An output folder's claim: held by the claiming launcher for its life, refused to another."""

from __future__ import annotations

import subprocess
import sys

import pytest

from layers.contract.config import ConfigError

from launcher.config.output_dirs import LOCK, claim


def test_a_folder_claimed_twice_by_one_launcher_is_kept(tmp_path):
    claim(str(tmp_path / "run"))
    claim(str(tmp_path / "run"))  # the same process: no refusal
    assert (tmp_path / "run" / LOCK).read_text().strip().isdigit()


@pytest.mark.slow  # launches a process
def test_a_folder_another_launcher_holds_is_refused(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from launcher.config.output_dirs import claim; "
                               f"claim({str(folder)!r}); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="in use by another launcher"):
            claim(str(folder))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    claim(str(folder))  # its launcher ended: the folder is free again
