"""The golden cache is bounded and found where the user's cache lives.

Least recently used cases go first, whole (a read counts as a use), the size cap holds after
every write, launcher runs included, only the cache's own entries are ever deleted, and the default folder follows `XDG_CACHE_HOME` unless
`DSV4_TP_GOLDEN_CACHE` names one. Every cache here is a temporary folder.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.config.spec import run_spec
from launcher.store import cache_dir, golden_cache
from layers.contract.config import ConfigError
from layers.contract.tensors import Kind, TensorSpec
from tests.conftest import multirun

SPECS = {"x_out": TensorSpec((64, 64), torch.float32, Kind.OUTPUT)}


def _ident(case: int, rank: int = 0) -> dict:
    return {"layer": "swa", "tp": 2, "seed": case, "rank": rank}  # one digit: every entry has the same size


def _outputs(i: int) -> dict:
    return {"x_out": torch.full((64, 64), float(i))}


def _entries(root: Path) -> list[tuple[Path, int]]:
    """The cache's entries, least recently used first, with their sizes."""
    return [(f.path, f.size) for f in cache_dir.listing(str(root)).entries]


def _kept(root: Path) -> list[tuple[int, int]]:
    """(case, rank) of the entries left, least recently used first."""
    idents = [json.loads(torch.load(p, weights_only=True)["identity"]) for p, _ in _entries(root)]
    return [(i["seed"], i["rank"]) for i in idents]


def test_the_least_recently_used_case_is_evicted_first_and_whole(tmp_path):
    for case in range(3):
        for rank in range(2):
            assert golden_cache.store(str(tmp_path), _ident(case, rank), _outputs(rank)) is None
    size = max(s for _, s in _entries(tmp_path))
    # Case 0's rank 1 read: case 0 is now the newest use, though its rank 0 is the oldest entry.
    assert golden_cache.load(str(tmp_path), _ident(0, 1), SPECS) is not None
    assert _kept(tmp_path) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (0, 1)]

    assert golden_cache.store(str(tmp_path), _ident(3, 0), _outputs(0), max_bytes=6 * size) is None
    # Case 1, the least recently used, went whole; case 0's old rank-0 entry stayed with its case.
    assert sorted(_kept(tmp_path)) == [(0, 0), (0, 1), (2, 0), (2, 1), (3, 0)]
    assert golden_cache.load(str(tmp_path), _ident(1, 1), SPECS) is None
    assert torch.equal(golden_cache.load(str(tmp_path), _ident(0, 0), SPECS)["x_out"], _outputs(0)["x_out"])

    assert golden_cache.store(str(tmp_path), _ident(3, 1), _outputs(1), max_bytes=2 * size) is None
    assert sorted(_kept(tmp_path)) == [(3, 0), (3, 1)]
    assert sum(s for _, s in _entries(tmp_path)) <= 2 * size


def test_an_entry_larger_than_the_cap_is_not_kept(tmp_path):
    assert golden_cache.store(str(tmp_path), _ident(0), _outputs(0)) is None
    problem = golden_cache.store(str(tmp_path), _ident(1), _outputs(1), max_bytes=100)
    assert problem and "evicted at once" in problem
    assert _kept(tmp_path) == []


def test_temp_files_of_writers_in_progress_are_neither_counted_nor_evicted_until_stale(tmp_path):
    assert golden_cache.store(str(tmp_path), _ident(0), _outputs(0)) is None
    entry = _entries(tmp_path)[0][0]
    in_progress, crashed = (tmp_path / f"{entry.name}.{pid}.tmp" for pid in (4242, 4343))
    in_progress.write_bytes(b"x" * 100_000)
    crashed.write_bytes(b"x" * 100_000)
    old = time.time() - cache_dir.STALE_TEMP_S - 60
    os.utime(crashed, (old, old))
    assert golden_cache.store(str(tmp_path), _ident(1), _outputs(1), max_bytes=50_000) is None
    assert in_progress.exists() and not crashed.exists()
    assert _kept(tmp_path) == [(0, 0), (1, 0)]
    assert golden_cache.load(str(tmp_path), _ident(0), SPECS) is not None  # a stray temp file is no entry


def test_only_the_caches_own_entries_are_ever_deleted(tmp_path):
    """A cap that keeps nothing, and `clear`, leave every file the harness did not write."""
    mine = {"checkpoint.pt": b"weights", "model-tp2-r0.pt": b"a user's", "notes.txt": b"text",
            "swa-tp2-r0-0123.pt.77.tmp": b"not an entry's temp file name"}
    assert golden_cache.store(str(tmp_path), _ident(0), _outputs(0)) is None  # marks the empty folder
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
        old = time.time() - cache_dir.STALE_TEMP_S - 3600
        os.utime(tmp_path / name, (old, old))  # older than every entry
    assert "evicted at once" in golden_cache.store(str(tmp_path), _ident(1), _outputs(1), max_bytes=1)
    assert cache_dir.clear(str(tmp_path)) == (0, 0)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != cache_dir.MARKER} == mine


def test_launcher_runs_keep_the_cap(tp_run, tmp_path):
    cache = tmp_path / "cache"
    first = tp_run(layer="swa", tp=2, model="tiny", golden_cache=str(cache))
    assert first.passed
    sizes = [s for _, s in _entries(cache)]
    assert len(sizes) == 5  # each rank's golden and inputs, the group's inputs
    cap_gb = (sum(sizes) + min(sizes) // 2) / 1e9  # room for one run's entries, not for a sixth

    second = tp_run(layer="swa", tp=2, model="tiny", seed=7, golden_cache=str(cache), golden_cache_max_gb=cap_gb)
    assert second.passed and second.result["golden_cache_problems"] == []
    assert sum(s for _, s in _entries(cache)) <= cap_gb * 1e9
    assert len(_entries(cache)) == 5
    again = tp_run(layer="swa", tp=2, model="tiny", seed=7, golden_cache=str(cache), golden_cache_max_gb=cap_gb)
    # the newest run's entries are the ones kept
    assert again.result["golden_cache_hits"] == [0, 1] and again.result["input_cache_hits"] == [0, 1]

    tight = tp_run(layer="swa", tp=2, model="tiny", seed=8, golden_cache=str(cache), golden_cache_max_gb=1e-6)
    assert tight.passed, tight  # a cache that keeps nothing never fails a run
    assert "evicted at once" in tight.report and _entries(cache) == []


def test_the_end_of_a_run_says_the_caches_size_once_past_half_its_cap(tp_run, tmp_path):
    cache = tmp_path / "cache"
    assert tp_run(layer="swa", tp=2, model="tiny", golden_cache=str(cache)).passed
    size = sum(s for _, s in _entries(cache))
    roomy = tp_run(layer="swa", tp=2, model="tiny", golden_cache=str(cache), golden_cache_max_gb=2.5 * size / 1e9)
    assert roomy.passed and "golden cache:" not in roomy.output
    full = tp_run(layer="swa", tp=2, model="tiny", golden_cache=str(cache), golden_cache_max_gb=1.5 * size / 1e9)
    assert full.passed and full.result["golden_cache_hits"] == [0, 1]
    line = next(ln for ln in full.output.splitlines() if ln.startswith("golden cache:"))
    assert f"{cache_dir.gb(size)} of its {cache_dir.gb(int(1.5 * size))} cap in {cache}" in line
    assert "python -m launcher.cache clear --yes" in line


def test_a_sweep_says_the_caches_size_once_at_its_end(tmp_path):
    cache = tmp_path / "cache"
    jobs = ["layer=swa", "tp=1", "model=tiny", "seed=1,2", f"golden_cache={cache}"]
    (tmp_path / "first").mkdir()
    first, summary, _ = multirun(tmp_path / "first", *jobs)
    assert summary["passed"] == 2, first.stdout + first.stderr
    size = sum(s for _, s in _entries(cache))
    (tmp_path / "again").mkdir()
    again, summary, _ = multirun(tmp_path / "again", *jobs, f"golden_cache_max_gb={1.5 * size / 1e9}")
    assert summary["passed"] == 2, again.stdout + again.stderr
    lines = [ln for ln in again.stdout.splitlines() if ln.startswith("golden cache:")]
    assert len(lines) == 1 and f"{cache_dir.gb(size)} of its" in lines[0], again.stdout
    assert again.stdout.rstrip().endswith(lines[0])  # after the sweep's table and summary line


def _compose(*overrides: str):
    with initialize_config_module(config_module="configs", version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_the_default_folder_follows_xdg_cache_home_and_the_env_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("DSV4_TP_GOLDEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert run_spec(_compose(), "/x").golden_cache == str(tmp_path / "xdg" / "dsv4-tp-harness" / "golden")

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the XDG rule says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "dsv4-tp-harness" / "golden"
    assert run_spec(_compose(), "/x").golden_cache == str(expected)

    monkeypatch.setenv("DSV4_TP_GOLDEN_CACHE", str(tmp_path / "mine"))
    assert run_spec(_compose(), "/x").golden_cache == str(tmp_path / "mine")
    assert run_spec(_compose("golden_cache=null"), "/x").golden_cache is None


def test_the_cap_is_a_config_key(monkeypatch):
    assert run_spec(_compose(), "/x").golden_cache_max_bytes == 4 * 10**9
    assert run_spec(_compose("golden_cache_max_gb=0.5"), "/x").golden_cache_max_bytes == 5 * 10**8
    assert run_spec(_compose("golden_cache_max_gb=null"), "/x").golden_cache_max_bytes is None
    with pytest.raises(ConfigError, match="golden_cache_max_gb"):
        run_spec(_compose("golden_cache_max_gb=0"), "/x")
