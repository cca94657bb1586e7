"""The golden cache's folder is the harness's alone, and a cache that cannot be written never
costs a run its verdict.

A folder with other files and no marker, the home and current folders are refused before any
rank starts; a full, read-only or failing cache warns once and the run goes on, leaving no temp
file; `python -m launcher.cache info|clear` reports and empties only the cache's own entries,
without torch. Full and read-only disks are tiny tmpfs mounts (`tests.tmpfs`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launcher.store import cache_dir, golden_cache
from layers.contract.config import ConfigError
from tests.conftest import REPO
from tests.tmpfs import tmpfs

SWA = dict(layer="swa", tp=2, model="tiny")
IDENT = {"layer": "swa", "tp": 2, "seed": 1, "rank": 0}


def _temps(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.endswith(".tmp")]


def test_a_folder_with_other_files_is_refused_before_any_rank_starts(tp_run, tmp_path):
    users = tmp_path / "work"
    users.mkdir()
    (users / "checkpoint.pt").write_bytes(b"a user's weights")
    run = tp_run(**SWA, golden_cache=str(users), golden_cache_max_gb=1e-9)
    assert run.exit_code == 2 and run.status == "config-error", run
    assert f"golden_cache={users} holds files the harness did not write (checkpoint.pt)" in run.output
    assert sorted(p.name for p in users.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize("where", ["current", "home", "parent of home"])
def test_the_home_and_current_folders_are_refused_even_when_empty(tmp_path, monkeypatch, where):
    home = tmp_path / "home" / "user"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    folder = {"current": tmp_path, "home": home, "parent of home": home.parent}[where]
    with pytest.raises(ConfigError, match="needs a folder of its own"):
        cache_dir.claim(str(folder))
    assert not (folder / cache_dir.MARKER).exists()
    assert golden_cache.store(str(folder), IDENT, {"x_out": torch.zeros(2)}) is not None  # not written
    assert not list(folder.glob("*.pt"))


def test_a_new_folder_is_marked_and_an_earlier_versions_entries_are_adopted(tmp_path):
    new = tmp_path / "new" / "cache"
    cache_dir.claim(str(new))
    assert (new / cache_dir.MARKER).is_file()
    old = tmp_path / "old"
    old.mkdir()
    legacy = old / "swa-tp2-r0-inputs-6237aac5fc4352a09269ff294d0d33df.pt"
    legacy.write_bytes(b"an entry of an earlier version")
    assert golden_cache.store(str(old), IDENT, {"x_out": torch.zeros(2)}) is None
    assert (old / cache_dir.MARKER).is_file() and not legacy.exists()
    assert [f.path.name for f in cache_dir.listing(str(old)).entries] == [cache_dir.entry_name(IDENT)]


def test_a_folder_another_process_claims_at_the_same_time_is_not_refused(tmp_path, monkeypatch):
    assert golden_cache.store(str(tmp_path), IDENT, {"x_out": torch.zeros(2)}) is None  # the other process
    monkeypatch.setattr(cache_dir, "is_marked", lambda root: False)  # our look came just before its marker
    cache_dir.claim(str(tmp_path))


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3968")])
def test_a_failing_write_returns_why_and_leaves_no_temp_file(tmp_path, monkeypatch, failure):
    def save(obj, path):  # writes part of the entry, then fails as torch.save does on a full disk
        Path(path).write_bytes(b"half an entry")
        raise failure

    monkeypatch.setattr(golden_cache.torch, "save", save)
    problem = golden_cache.store(str(tmp_path), IDENT, {"x_out": torch.zeros(2)})
    assert problem in ("OSError: No space left on device", "torch.save failed (a full disk?)")
    assert _temps(tmp_path) == [] and cache_dir.listing(str(tmp_path)).entries == []


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_a_full_or_read_only_cache_warns_once_and_every_run_passes(tp_run, tmp_path, disk):
    with tmpfs(tmp_path / "disk", size="64k", read_only=disk == "read-only") as mount:
        cache = mount / "cache"
        if disk == "read-only":  # the mount itself, empty and unmarked: the marker cannot be written either
            cache = mount
        for _ in range(2):  # a failed write must not break the next run
            run = tp_run(**SWA, golden_cache=str(cache))
            assert run.passed, run
            assert len(run.result["golden_cache_problems"]) == 1, run.result["golden_cache_problems"]
            assert run.report.count("warning: golden cache not written") == 1, run.report
            assert not cache.exists() or _temps(cache) == []


def test_a_stale_temp_file_of_a_crashed_writer_is_ignored_and_cleaned(tp_run, tmp_path):
    cache = tmp_path / "cache"
    assert tp_run(**SWA, golden_cache=str(cache)).passed
    entry = cache_dir.listing(str(cache)).entries[0].path
    crashed = cache / f"{entry.name}.999999.tmp"
    crashed.write_bytes(b"half an entry")
    old = entry.stat().st_mtime - cache_dir.STALE_TEMP_S - 60
    os.utime(crashed, (old, old))
    again = tp_run(**SWA, golden_cache=str(cache), seed=5, golden_cache_max_gb=100)
    assert again.passed and again.result["golden_cache_problems"] == [], again
    assert not crashed.exists()


def _cache_cli(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from launcher.cache import main; status = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'launcher.cache imported torch'; sys.exit(status)")
    return subprocess.run([sys.executable, "-c", code, *args], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)


def test_the_cache_command_reports_and_clears_only_the_caches_entries(tmp_path):
    cache = tmp_path / "cache"
    for seed in (1, 2):
        for rank in (0, 1):
            assert golden_cache.store(str(cache), {**IDENT, "seed": seed, "rank": rank}, {"x_out": torch.zeros(9)}) is None
    (cache / "notes.txt").write_text("mine")
    listed = cache_dir.listing(str(cache))

    info = _cache_cli("info", "--dir", str(cache), "--max-gb", "2")
    assert info.returncode == 0, info.stderr
    assert f"golden cache: {cache}\n" in info.stdout
    assert f"size: {cache_dir.gb(listed.size)} (cap 2.00 GB); 4 entries of 2 cases" in info.stdout
    assert "oldest use: " in info.stdout and "newest use: " in info.stdout

    unasked = _cache_cli("clear", "--dir", str(cache))
    assert unasked.returncode == 2 and "add --yes" in unasked.stderr
    assert len(cache_dir.listing(str(cache)).entries) == 4

    cleared = _cache_cli("clear", "--dir", str(cache), "--yes")
    assert cleared.returncode == 0, cleared.stderr
    assert sorted(p.name for p in cache.iterdir()) == [cache_dir.MARKER, "notes.txt"]

    users = tmp_path / "users"
    users.mkdir()
    (users / "model.pt").write_bytes(b"weights")
    refused = _cache_cli("clear", "--dir", str(users), "--yes")
    assert refused.returncode == 2 and "is not a golden cache folder" in refused.stderr
    assert (users / "model.pt").exists()


def test_the_cache_command_runs_as_a_module(tmp_path):
    p = subprocess.run([sys.executable, "-m", "launcher.cache", "info", "--dir", str(tmp_path / "none")],
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"no golden cache at {tmp_path / 'none'}" in p.stdout, p.stderr
