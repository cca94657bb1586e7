"""Snapshots in the reference layout: save, replay, refuse what does not fit, cache goldens."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from launcher.store import snapshot
from layers.contract.tensors import Kind
from layers.contract.case import Case
from layers.contract.config import TINY, ConfigError
from layers.registry import get_layer

from ..conftest import run_cli

LAYERS = ["swa", "csa", "hca"]


@pytest.fixture
def saved(tp_run, tmp_path):
    """A tiny tp=2 SWA snapshot written by a passing run."""
    out = tmp_path / "snap"
    run = tp_run(layer="swa", tp=2, model="tiny", save_data=str(out), golden_cache=None)
    assert run.passed, run
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_save_then_replay_passes(tp_run, tmp_path, layer):
    out = tmp_path / "snap"
    first = tp_run(layer=layer, tp=2, model="tiny", save_data=str(out), golden_cache=None)
    assert first.passed, first
    specs = get_layer(layer).tensor_specs(Case(layer, TINY, 2, TINY.decode_tokens // 2, 0))
    for name, spec in specs.items():
        subs = {Kind.INPUT: ["in"], Kind.INOUT: ["in", "out"], Kind.OUTPUT: ["out"]}[spec.kind]
        for sub in subs:
            t = torch.load(out / sub / f"{name}.pt", weights_only=True)
            assert tuple(t.shape) == (spec.shape if spec.shape == () else (2, *spec.shape)), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["layer"], manifest["tp"], manifest["model"]) == (layer, 2, "tiny")
    assert set(manifest["sha256"]) >= {"out/x_out.pt", "in/x_hc.pt"}
    replay = tp_run(layer=layer, tp=2, model="tiny", golden_data=str(out), recompute_golden=True)
    assert replay.passed, replay
    assert replay.result["reference"] == "snapshot" and "recomputed_verdicts" in replay.result


def test_a_nonfinite_golden_is_a_reference_error_not_a_fail(tp_run, saved):
    path = saved / "out" / "x_out.pt"
    x = torch.load(path, weights_only=True)
    x[1, 3, 0, :5] = float("nan")
    torch.save(x, path)
    manifest = json.loads((saved / "manifest.json").read_text())  # a consistent snapshot, its golden broken
    manifest["sha256"]["out/x_out.pt"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (saved / "manifest.json").write_text(json.dumps(snapshot.sealed(manifest)))
    run = tp_run(layer="swa", tp=2, model="tiny", golden_data=str(saved))
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (1, "golden"), run
    assert f"the snapshot's {saved}/out/x_out.pt holds 5 non-finite value(s) in x_out" in err["message"]
    assert "GoldenNotFinite" in run.report and "a reference error" in run.report


def test_tampered_output_fails_naming_it(tp_run, saved):
    path = saved / "out" / "x_out.pt"
    x = torch.load(path, weights_only=True)
    x[1, :8] += 1.0
    torch.save(x, path)
    (saved / "manifest.json").unlink()  # as the reference's snapshots: no sha256 to refuse it by
    run = tp_run(layer="swa", tp=2, model="tiny", golden_data=str(saved))
    assert run.exit_code == 1, run
    assert not run.verdict("x_out")["passed"] and run.verdict("kv_cache")["passed"]
    assert [r["rank"] for r in run.verdict("x_out")["per_rank"] if r["n_bad"]] == [1]


def _edit_seed(manifest):
    manifest["seed"] += 1


def _edit_model_fields(manifest):
    manifest["model_fields"]["rope_theta"] *= 2  # no shape shows it: only the manifest says it


def _drop_digest(manifest):
    del manifest[snapshot.MANIFEST_HASH]


@pytest.mark.parametrize("edit, why", [
    (_edit_seed, f"its content is not the one its {snapshot.MANIFEST_HASH} records (the manifest was edited"),
    (_edit_model_fields, f"its content is not the one its {snapshot.MANIFEST_HASH} records (the manifest was edited"),
    (_drop_digest, f"records no {snapshot.MANIFEST_HASH}, so its case cannot be trusted"),
])
def test_a_manifest_edited_after_the_save_is_refused(tp_run, saved, edit, why):
    path = saved / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=1))
    run = tp_run(golden_data=str(saved))
    assert run.exit_code == 2 and run.result["status"] == "config-error", run
    assert run.result["error"]["message"].startswith(f"{path}: {why}"), run.result["error"]["message"]


def test_a_manifest_laid_out_anew_is_still_its_own(tp_run, saved):
    path = saved / "manifest.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4, sort_keys=True))  # same content
    assert tp_run(golden_data=str(saved)).passed


class _RunsCode:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "in" / "wq_a.pt").unlink(), "golden_data is missing files"),
        (lambda d: torch.save(torch.zeros(2, 3), d / "in" / "wq_a.pt"), "in/wq_a.pt: shape (2, 3)"),
        (lambda d: torch.save(torch.load(d / "in" / "x_hc.pt").double(), d / "in" / "x_hc.pt"), "dtype torch.float64"),
        (lambda d: torch.save(torch.load(d / "in" / "x_hc.pt")[:1], d / "in" / "x_hc.pt"), "leading axis = tp = 2"),
        (lambda d: torch.save({"x": torch.zeros(1)}, d / "in" / "x_hc.pt"), "holds a dict, expected one tensor"),
        (lambda d: torch.save(_RunsCode(), d / "in" / "x_hc.pt"), "refused to load, it is not plain tensor data"),
        (lambda d: torch.save(torch.tensor(48, dtype=torch.int32), d / "in" / "local_t.pt"), "expected shape (2, 48, 4, 256)"),
    ],
)
def test_malformed_snapshot_is_refused_before_launch(saved, tmp_path, damage, message):
    damage(saved)
    p = run_cli(["layer=swa", "tp=2", "model=tiny", f"golden_data={saved}"], tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert "this must never run" not in p.stdout + p.stderr
    assert not (tmp_path / "out" / "logs").exists()


def test_local_t_on_the_command_line_must_match_the_snapshot(saved, tmp_path):
    p = run_cli(["layer=swa", "tp=2", "model=tiny", "local_t=48", f"golden_data={saved}"], tmp_path, timeout=120)
    assert p.returncode == 2 and "holds local_t=64" in p.stderr


def test_rank_slices_equal_the_stacked_tensors(saved):
    specs = get_layer("swa").tensor_specs(Case("swa", TINY, 2, 64, 0))
    names = [n for n, s in specs.items() if s.kind is not Kind.OUTPUT]
    for rank in range(2):
        sliced = snapshot.load_rank(str(saved), "in", names, rank, specs)
        for n in names:
            full = torch.load(saved / "in" / f"{n}.pt", weights_only=True)
            want = full if specs[n].shape == () else full[rank]
            assert torch.equal(sliced[n].view(torch.uint8) if sliced[n].dtype == torch.bfloat16 else sliced[n],
                               want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), n


def test_golden_cache_hit_then_miss_after_seed_change(tp_run, tmp_path):
    cache = str(tmp_path / "cache")
    first = tp_run(layer="swa", tp=2, model="tiny", golden_cache=cache)
    second = tp_run(layer="swa", tp=2, model="tiny", golden_cache=cache)
    third = tp_run(layer="swa", tp=2, model="tiny", golden_cache=cache, seed=7)
    assert first.passed and second.passed and third.passed
    assert first.result["golden_cache_hits"] == []
    assert second.result["golden_cache_hits"] == [0, 1]
    assert "from the golden cache on ranks [0, 1]" in second.report
    assert third.result["golden_cache_hits"] == []


def test_cached_golden_still_catches_a_defect(tp_run, tmp_path):
    cache = str(tmp_path / "cache")
    assert tp_run(layer="swa", tp=2, model="tiny", golden_cache=cache).passed
    run = tp_run(layer="swa", tp=2, model="tiny", golden_cache=cache, impl="tests.defects.SkipCacheWrite")
    assert run.result["golden_cache_hits"] == [0, 1] and run.exit_code == 1


def test_snapshot_check_unit(saved):
    specs = get_layer("swa").tensor_specs(Case("swa", TINY, 2, 64, 0))
    snapshot.check(str(saved), specs, 2)
    with pytest.raises(ConfigError, match="leading axis = tp = 4"):
        snapshot.check(str(saved), specs, 4)
    shutil.rmtree(saved / "out")
    with pytest.raises(ConfigError, match="missing files"):
        snapshot.check(str(saved), specs, 2)
