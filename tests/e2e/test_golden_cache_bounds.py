"""The golden cache is bounded and found where the user's cache lives.

Least recently used entries go first (a read counts as a use), the size cap holds after every
write, launcher runs included, and the default folder follows `XDG_CACHE_HOME` unless
`DSV4_TP_GOLDEN_CACHE` names one. Every cache here is a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.config.spec import run_spec
from launcher.store import golden_cache
from layers.contract.config import ConfigError
from layers.contract.tensors import Kind, TensorSpec

SPECS = {"x_out": TensorSpec((64, 64), torch.float32, Kind.OUTPUT)}


def _ident(i: int) -> dict:
    return {"layer": "swa", "tp": 1, "rank": i}  # one digit: every entry has the same size


def _outputs(i: int) -> dict:
    return {"x_out": torch.full((64, 64), float(i))}


def _ranks(root: Path) -> list[int]:
    """The ranks of the entries left, least recently used first."""
    return [int(p.name.split("-r")[1].split("-")[0]) for p, _ in golden_cache.entries(str(root))]


def test_the_least_recently_used_entry_is_evicted_first(tmp_path):
    for i in range(3):
        assert golden_cache.store(str(tmp_path), _ident(i), _outputs(i)) is None
    size = max(s for _, s in golden_cache.entries(str(tmp_path)))
    assert golden_cache.load(str(tmp_path), _ident(0), SPECS) is not None  # 0 is now the newest use
    assert _ranks(tmp_path) == [1, 2, 0]

    assert golden_cache.store(str(tmp_path), _ident(3), _outputs(3), max_bytes=3 * size) is None
    assert _ranks(tmp_path) == [2, 0, 3]  # 1, the least recently used, went; 0 was kept by its read
    assert golden_cache.load(str(tmp_path), _ident(1), SPECS) is None
    assert torch.equal(golden_cache.load(str(tmp_path), _ident(0), SPECS)["x_out"], _outputs(0)["x_out"])

    assert golden_cache.store(str(tmp_path), _ident(4), _outputs(4), max_bytes=2 * size) is None
    assert _ranks(tmp_path) == [0, 4]
    assert sum(s for _, s in golden_cache.entries(str(tmp_path))) <= 2 * size


def test_an_entry_larger_than_the_cap_is_not_kept(tmp_path):
    assert golden_cache.store(str(tmp_path), _ident(0), _outputs(0)) is None
    problem = golden_cache.store(str(tmp_path), _ident(1), _outputs(1), max_bytes=100)
    assert problem and "evicted at once" in problem
    assert _ranks(tmp_path) == []


def test_temp_files_of_writers_in_progress_are_neither_counted_nor_evicted(tmp_path):
    in_progress = tmp_path / "swa-tp1-r9-0123.pt.4242.tmp"
    in_progress.write_bytes(b"x" * 100_000)
    assert golden_cache.store(str(tmp_path), _ident(0), _outputs(0), max_bytes=50_000) is None
    assert in_progress.exists() and _ranks(tmp_path) == [0]


def test_launcher_runs_keep_the_cap(tp_run, tmp_path):
    cache = tmp_path / "cache"
    first = tp_run(layer="swa", tp=2, model="tiny", golden_cache=str(cache))
    assert first.passed
    sizes = [s for _, s in golden_cache.entries(str(cache))]
    assert len(sizes) == 5  # each rank's golden and inputs, the group's inputs
    cap_gb = (sum(sizes) + min(sizes) // 2) / 1e9  # room for one run's entries, not for a sixth

    second = tp_run(layer="swa", tp=2, model="tiny", seed=7, golden_cache=str(cache), golden_cache_max_gb=cap_gb)
    assert second.passed and second.result["golden_cache_problems"] == []
    assert sum(s for _, s in golden_cache.entries(str(cache))) <= cap_gb * 1e9
    assert len(golden_cache.entries(str(cache))) == 5
    again = tp_run(layer="swa", tp=2, model="tiny", seed=7, golden_cache=str(cache), golden_cache_max_gb=cap_gb)
    # the newest run's entries are the ones kept
    assert again.result["golden_cache_hits"] == [0, 1] and again.result["input_cache_hits"] == [0, 1]

    tight = tp_run(layer="swa", tp=2, model="tiny", seed=8, golden_cache=str(cache), golden_cache_max_gb=1e-6)
    assert tight.passed, tight  # a cache that keeps nothing never fails a run
    assert "evicted at once" in tight.report and golden_cache.entries(str(cache)) == []


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
