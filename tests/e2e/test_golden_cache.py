"""The golden cache trusts only whole entries: a tampered, damaged or foreign entry is a miss.

Each test fills a cache with a correct run, damages its entries the way a user, a disk or an
older version could, and checks the next run's verdict and whether it read or rewrote them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher.store import golden_cache
from layers.contract.tensors import Kind, TensorSpec

SWA = dict(layer="swa", tp=2, model="tiny")


def _entries(cache: Path) -> dict[int, Path]:
    """The cache's entry files by rank (one case per cache here)."""
    found = {}
    for path in cache.glob("*.pt"):
        found[int(path.name.split("-r")[1].split("-")[0])] = path
    return found


def _edit(path: Path, change) -> None:
    entry = torch.load(path, weights_only=True)
    change(entry)
    torch.save(entry, path)


def test_a_tampered_entry_cannot_make_a_defect_pass(tp_run, tmp_path):
    # The entry's x_out is edited to what tests.defects.PerturbRankTokens returns on rank 1: an
    # entry trusted on load would turn that defect's FAIL into a PASS.
    cache = tmp_path / "cache"
    assert tp_run(**SWA, golden_cache=str(cache)).passed
    seq = 8

    def perturb(entry):
        x_out = entry["outputs"]["x_out"]
        x_out[:seq] = x_out[:seq] * 1.5 + 0.25

    _edit(_entries(cache)[1], perturb)
    run = tp_run(**SWA, golden_cache=str(cache), impl="tests.defects.PerturbRankTokens")
    assert run.exit_code == 1, run
    assert run.result["golden_cache_hits"] == [0]  # rank 1's entry was recomputed
    assert run.verdict("x_out")["passed"] is False


@pytest.mark.parametrize("damage", ["flipped_bytes", "wrong_shape", "missing_key", "malformed_outputs", "garbage"])
def test_a_damaged_entry_is_recomputed_and_replaced(tp_run, tmp_path, damage):
    cache = tmp_path / "cache"
    assert tp_run(**SWA, golden_cache=str(cache)).passed
    path = _entries(cache)[0]
    if damage == "flipped_bytes":
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 4000] = bytes(b ^ 0x5A for b in data[middle : middle + 4000])
        path.write_bytes(bytes(data))
    elif damage == "wrong_shape":
        _edit(path, lambda e: e["outputs"].__setitem__("x_out", e["outputs"]["x_out"][:8].clone()))
    elif damage == "missing_key":
        _edit(path, lambda e: e["outputs"].pop("kv_cache"))
    elif damage == "malformed_outputs":
        _edit(path, lambda e: e.__setitem__("outputs", [1, 2, 3]))
    else:
        path.write_bytes(b"not a torch file")
    second = tp_run(**SWA, golden_cache=str(cache))
    assert second.passed, second
    assert second.result["golden_cache_hits"] == [1]
    third = tp_run(**SWA, golden_cache=str(cache))
    assert third.passed and third.result["golden_cache_hits"] == [0, 1]  # the entry was rewritten


def test_an_unusable_cache_location_warns_and_the_run_goes_on(tp_run, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    run = tp_run(**SWA, golden_cache=str(not_a_folder))
    assert run.passed, run
    assert run.result["golden_cache_problems"] and "warning: golden cache not written" in run.report

    cache = tmp_path / "cache"
    assert tp_run(**SWA, golden_cache=str(cache)).passed
    entry = _entries(cache)[0]
    entry.unlink()
    entry.mkdir()  # the entry's path is a folder: unreadable and unwritable
    run = tp_run(**SWA, golden_cache=str(cache))
    assert run.passed, run
    assert run.result["golden_cache_hits"] == [1] and run.result["golden_cache_problems"]
    assert not list(cache.glob("*.tmp")), "a temp file stayed behind"


def test_load_checks_names_shapes_dtypes_and_digests(tmp_path):
    specs = {"x_out": TensorSpec((2, 3), torch.float32, Kind.OUTPUT)}
    ident = {"layer": "swa", "tp": 1, "rank": 0}
    good = {"x_out": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    assert golden_cache.store(str(tmp_path), ident, good) is None
    assert torch.equal(golden_cache.load(str(tmp_path), ident, specs)["x_out"], good["x_out"])
    assert golden_cache.load(str(tmp_path), {**ident, "rank": 1}, specs) is None  # another identity
    wrong_dtype = {"x_out": TensorSpec((2, 3), torch.bfloat16, Kind.OUTPUT)}
    assert golden_cache.load(str(tmp_path), ident, wrong_dtype) is None
    extra = {**specs, "kv_cache": TensorSpec((1,), torch.float32, Kind.INOUT)}
    assert golden_cache.load(str(tmp_path), ident, extra) is None
    # A value changed without its digest: a miss.
    path = next(tmp_path.glob("*.pt"))
    _edit(path, lambda e: e["outputs"]["x_out"].add_(1))
    assert golden_cache.load(str(tmp_path), ident, specs) is None


def test_the_source_hash_covers_nested_packages(tmp_path):
    (tmp_path / "components").mkdir()
    nested = tmp_path / "components" / "math.py"
    nested.write_text("x = 1\n")
    (tmp_path / "top.py").write_text("y = 2\n")
    before = golden_cache.source_hash(tmp_path)
    nested.write_text("x = 2\n")
    assert golden_cache.source_hash(tmp_path) != before
