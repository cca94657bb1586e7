"""Replay: `golden_data=DIR` alone replays any snapshot, ours or the reference's; the reference
runner's replay rules; a snapshot that was tampered with, or a save that would mix two, is
refused before launch."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.pytest_plugin import run_layer
from launcher.report.regressions import Thresholds, compare, match
from launcher.report.regressions import load as compare_jobs
from launcher.report.regressions import render as render_comparison
from launcher.report.sweep_summary import case_name, job_row
from launcher.run.preflight import preflight
from launcher.store import golden_cache
from launcher.store.snapshot_layer import with_snapshot_layer
from layers.contract.config import ConfigError
from layers.registry import get_layer

from ..conftest import reference_snapshot, run_cli

LAYERS = ["swa", "csa", "hca"]


def _preflight(*overrides: str):
    """The preflight of a command line (its overrides say what the user gave), composed as the
    command line composes it: with the replayed snapshot's layer group."""
    overrides = with_snapshot_layer(overrides)
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return preflight(cfg, "/nonexistent", overrides)


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        _preflight(*overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """A tiny tp=2 SWA snapshot written by one passing run for the whole module."""
    folder = tmp_path_factory.mktemp("saved")
    run = run_layer(str(folder / "run"), layer="swa", tp=2, model="tiny", save_data=str(folder / "snap"),
                    golden_cache=None)
    assert run.passed, run
    return folder / "snap"


@pytest.fixture
def saved(saved_once, tmp_path):
    """This test's own copy of that snapshot, to damage or overwrite."""
    out = tmp_path / "snap"
    shutil.copytree(saved_once, out)
    return out


# -- the case a snapshot holds -----------------------------------------------------------------
@pytest.mark.parametrize("layer", LAYERS)
def test_reference_snapshot_replays_from_golden_data_alone(tp_run, layer):
    src = reference_snapshot(layer)
    run = tp_run(golden_data=str(src), recompute_golden=True)
    assert run.passed and "recomputed_verdicts" in run.result, run
    case = run.result["case"]
    assert (case["layer"], case["model"], case["tp"], case["local_t"], case["start_pos"]) == (layer, "mini", 2, 32, None)
    read = run.result["snapshot"]["read"]
    assert {"layer", "tp", "local_t", "start_pos", "model"} <= set(read)
    assert run.result["snapshot"]["tp"]["source"] == str(src / "in" / "x_hc.pt")
    assert f"snapshot {src}: layer={layer}" in run.report
    assert not (src / "manifest.json").exists()  # replay is read-only


@pytest.mark.parametrize("layer", [*LAYERS, "moe"])
def test_a_perturbed_reference_snapshot_fails(tp_run, tmp_path, layer):
    """The shipped reference data can fail a run: 16 tokens of the reference's output moved on
    every rank (more than the MoE comparator's 5% budget; one token fails the attention's)."""
    snap = tmp_path / "snap"
    shutil.copytree(reference_snapshot(layer), snap)
    name = "x_next" if layer == "moe" else "x_out"
    out = torch.load(snap / "out" / f"{name}.pt", weights_only=True)
    out[:, :16] += 0.5
    torch.save(out, snap / "out" / f"{name}.pt")
    run = tp_run(golden_data=str(snap))
    verdict = next(v for v in run.result["verdicts"] if v["tensor"] == name)
    assert not run.passed and verdict["passed"] is False, run


def _shown_seeds(run) -> tuple[object, str, str]:
    """What a run says of its seed: result.json's case, the header line, report.html's case."""
    header = run.report.splitlines()[0]
    page = (Path(run.output_dir) / "report.html").read_text()
    return run.result["case"]["seed"], header, page


@pytest.mark.parametrize("layer", ["swa", "moe"])
def test_a_reference_replay_claims_no_seed(tp_run, layer):
    """The reference records no seed of ours and gives every input: no seed played a part, so
    no report shows the config's (here a given one) as if it were the snapshot's."""
    src = reference_snapshot(layer)
    run = tp_run(golden_data=str(src), seed=4242)
    assert run.passed, run
    seed, header, page = _shown_seeds(run)
    assert seed is None and "seed" not in run.result["snapshot"]["read"]
    assert " seed=- " in header and "4242" not in header, header
    assert "seed=<code>-</code>" in page and "4242" not in page
    # compare: the replay is its own case, never one with a seeded run of the same dims
    replay = compare_jobs(run.output_dir)
    seeded = [dataclasses.replace(j, case={**j.case, "seed": 4242}, seedless=False) for j in replay]
    assert match(replay, seeded)[0] == [] and len(match(replay, replay)[0]) == 1
    assert "seed=- " in render_comparison(compare(replay, replay, Thresholds()))
    # a sweep's job name (junit) of the same run, the seed it was given left out as unused
    job = case_name(job_row(1, [f"golden_data={src}", "seed=4242"], run.output_dir, run.result))
    assert "seed=-" in job.split() and "4242" not in job, job


def test_a_reference_replay_shares_no_golden_cache_identity_with_a_seeded_run():
    replay = _preflight(f"golden_data={reference_snapshot('swa')}").case
    seeded = _preflight("layer=swa", "model=mini", "tp=2", "local_t=32").case
    assert dataclasses.replace(replay, seed=seeded.seed) == seeded  # the same dims
    assert golden_cache.identity(replay, 0, 2) != golden_cache.identity(seeded, 0, 2)


def test_our_snapshot_replay_shows_its_recorded_seed(tp_run, tmp_path):
    snap = tmp_path / "snap"
    assert tp_run(layer="swa", tp=2, model="tiny", seed=4242, save_data=str(snap), golden_cache=None).passed
    run = tp_run(golden_data=str(snap))
    assert run.passed, run
    seed, header, page = _shown_seeds(run)
    assert seed == 4242 and run.result["snapshot"]["seed"]["source"] == str(snap / "manifest.json")
    assert " seed=4242 " in header, header
    assert "seed=<code>4242</code>" in page


def test_a_resaved_reference_replay_still_claims_no_seed(tp_run, tmp_path):
    """A reference replay saved as our snapshot records a null seed, which its replay reads as none."""
    snap = tmp_path / "snap"
    assert tp_run(golden_data=str(reference_snapshot("swa")), save_data=str(snap)).passed
    assert json.loads((snap / "manifest.json").read_text())["seed"] is None
    run = tp_run(golden_data=str(snap))
    assert run.passed, run
    seed, header, page = _shown_seeds(run)
    assert seed is None and " seed=- " in header and "seed=<code>-</code>" in page


def test_keys_that_agree_with_the_snapshot_are_accepted():
    src = reference_snapshot("hca")
    spec = _preflight(f"golden_data={src}", "layer=hca", "tp=2", "model=mini", "local_t=32", "scope=full")
    assert (spec.case.layer, spec.case.tp, spec.case.local_t, spec.case.model.name) == ("hca", 2, 32, "mini")


@pytest.mark.parametrize(
    "key, given, held, file",
    [
        ("tp", "4", "tp=2", "in/x_hc.pt"),  # not a local_t message: the tp is named
        ("layer", "swa", "layer=hca", "in/cmp_kv.pt"),  # the reference names its layer by its tensors
        ("local_t", "24", "local_t=32", "in/local_t.pt"),
        ("model", "tiny", "hidden_size=512", "in/x_hc.pt"),
        ("model.q_lora_rank", "256", "q_lora_rank=128", "in/wq_a.pt"),
        ("start_pos", "0", "start_pos=[[", "in/position_ids.pt"),
    ],
)
def test_a_key_that_contradicts_the_snapshot_names_key_values_and_file(key, given, held, file):
    src = reference_snapshot("hca")
    message = _refused(f"golden_data={src}", f"{key}={given}")
    assert message.startswith(f"{key}={given} contradicts the snapshot: {src / file} holds ") and held in message, message


def test_a_contradicting_key_is_refused_before_any_rank_starts(tmp_path):
    src = reference_snapshot("swa")
    p = run_cli([f"golden_data={src}", "tp=4"], tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: tp=4 contradicts the snapshot: {src}/in/x_hc.pt holds tp=2 (its leading axis)"]
    assert not (tmp_path / "out" / "logs").exists()


def test_a_long_context_snapshot_without_manifest_replays_alone(tmp_path, tp_run):
    """hca.md §9: cmp_block_table's width follows the starts (254 pages at 1040000)."""
    snap = tmp_path / "snap"
    first = tp_run(layer="hca", tp=2, model="tiny", local_t=8, start_pos=1040000, save_data=str(snap),
                   golden_cache=None)
    assert first.passed, first
    assert torch.load(snap / "in" / "cmp_block_table.pt", weights_only=True).shape == (2, 1, 254)
    (snap / "manifest.json").unlink()  # as the reference writes it
    p = run_cli([f"golden_data={snap}"], tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"snapshot {snap}: layer=hca scope=full model=tiny tp=2 local_t=8 seed=- start_pos=1040000" in p.stdout
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["case"]["start_pos"] == 1040000 and result["passed"]


def test_per_rank_starts_that_differ_replay_alone(tmp_path, tp_run):
    snap = tmp_path / "snap"
    first = tp_run(layer="csa", tp=2, model="tiny", save_data=str(snap), golden_cache=None, overrides=["+starts=mixed"])
    assert first.passed, first
    saved = first.result["case"]["start_pos"]
    (snap / "manifest.json").unlink()
    replay = tp_run(golden_data=str(snap))
    assert replay.passed, replay
    starts = replay.result["snapshot"]["start_pos"]["value"]
    assert starts[0] != starts[1]  # the ranks' requests start differently
    assert replay.result["case"]["start_pos"] == saved == starts[0] + starts[1]


def test_the_moe_snapshot_replays_from_golden_data_alone(tp_run):
    """layer=moe from its expert tensors, ep from the leading axis, layer_id and num_tokens from
    their scalar files, the model from the shapes."""
    src = reference_snapshot("moe")
    run = tp_run(golden_data=str(src), recompute_golden=True)
    assert run.passed and "recomputed_verdicts" in run.result, run
    case = run.result["case"]
    assert (case["layer"], case["model"], case["ep"], case["layer_id"], case["num_tokens"]) == ("moe", "tiny", 2, 4, 96)
    assert run.result["snapshot"]["ep"]["source"] == str(src / "in" / "x_hc.pt")
    assert {"layer", "ep", "layer_id", "num_tokens", "model"} <= set(run.result["snapshot"]["read"])


@pytest.mark.parametrize("key, given, held, file", [
    ("ep", "4", "ep=2", "in/x_hc.pt"),
    ("layer_id", "1", "layer_id=4", "in/layer_id.pt"),
    ("num_tokens", "5", "num_tokens=96", "in/num_tokens.pt"),
    ("layer", "swa", "layer=moe", "in/tid2eid.pt"),
])
def test_a_key_that_contradicts_the_moe_snapshot_is_refused(key, given, held, file):
    src = reference_snapshot("moe")
    message = _refused(f"golden_data={src}", f"{key}={given}")
    assert message.startswith(f"{key}={given} contradicts the snapshot: {src / file} holds {held}"), message


def test_starts_must_agree_with_kv_seq_lens(tmp_path):
    snap = tmp_path / "snap"
    shutil.copytree(reference_snapshot("hca"), snap)
    lens = torch.load(snap / "in" / "kv_seq_lens.pt", weights_only=True)
    lens[1, 3] += 1
    torch.save(lens, snap / "in" / "kv_seq_lens.pt")
    message = _refused(f"golden_data={snap}")
    assert message.startswith(f"{snap}/in/kv_seq_lens.pt: rank 1 request 3 has kv_seq_len"), message


# -- the reference runner's replay rules (validation.md §4, §13.8 H4, H7, H8) -------------------
def test_an_empty_snapshot_lists_every_missing_file(tmp_path):
    message = _refused(f"golden_data={tmp_path}", "model=tiny", "tp=2")
    assert message.startswith("golden_data is missing files: [")
    specs = get_layer("swa").tensor_specs(_preflight("model=tiny", "tp=2").case)
    expected = {str(tmp_path / sub / f"{n}.pt") for n, s in specs.items()
                for sub in {"input": ["in"], "inout": ["in", "out"], "output": ["out"]}[s.kind.value]}
    assert {p.strip(" '") for p in message.split("[", 1)[1].rstrip("]").split(",")} == expected


def test_a_partial_snapshot_lists_every_missing_in_file(saved):
    """Only out/ is left: its layer, tp, local_t and model still tell which in/ files are missing."""
    shutil.rmtree(saved / "in")
    (saved / "manifest.json").unlink()
    message = _refused(f"golden_data={saved}")
    specs = get_layer("swa").tensor_specs(_preflight("model=tiny", "tp=2").case)
    expected = {str(saved / "in" / f"{n}.pt") for n, s in specs.items() if s.kind.value != "output"}
    assert message.startswith("golden_data is missing files: [")
    assert {p.strip(" '") for p in message.split("[", 1)[1].rstrip("]").split(",")} == expected


@pytest.mark.parametrize(
    "value, message",
    [
        (torch.tensor([64], dtype=torch.int32), "in/local_t.pt must contain a 0-dim torch.Tensor, got (1,)"),
        (torch.tensor(64, dtype=torch.int64), "in/local_t.pt dtype mismatch: spec=torch.int32 cache=torch.int64"),
    ],
)
def test_a_scalar_file_must_be_a_0_dim_tensor_of_its_dtype(saved, value, message):
    torch.save(value, saved / "in" / "local_t.pt")
    assert message in _refused(f"golden_data={saved}")


class RecordsThatItRan:
    """An implementation that leaves a file behind when it is called."""

    def __init__(self, marker_dir: str):
        self.marker_dir = marker_dir

    def __call__(self, ctx, tensors):
        Path(self.marker_dir, f"rank{ctx.rank}").touch()
        return get_layer("swa").forward(ctx, tensors)


def test_a_golden_that_fails_stops_the_run_before_the_implementation_runs(tp_run, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    run = tp_run(layer="swa", tp=2, model="tiny", golden_cache=None, impl=RecordsThatItRan,
                 overrides=[f"+impl.marker_dir={markers}", "fault.kind=raise", "fault.rank=1", "fault.phase=golden"])
    assert run.exit_code == 2, run
    error = run.result["error"]
    assert (error["rank"], error["phase"]) == (1, "golden"), error
    assert list(markers.iterdir()) == []  # no rank ran the implementation


# -- snapshots that were tampered with, and saves that would mix two (issue: trust) -----------
def test_flipped_bytes_of_a_saved_file_are_refused(saved):
    path = saved / "out" / "kv_cache.pt"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))
    message = _refused(f"golden_data={saved}")
    assert message.startswith(f"{path}: its sha256 is not the one {saved}/manifest.json records"), message


def test_a_symlink_to_a_file_that_is_not_a_torch_archive(saved, tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("not a tensor\n")
    (saved / "in" / "wq_a.pt").unlink()
    (saved / "in" / "wq_a.pt").symlink_to(other)
    message = _refused(f"golden_data={saved}")
    assert message.startswith(f"{saved}/in/wq_a.pt: not a torch.save file, a symlink to {os.path.realpath(other)}")
    assert "mmap" not in message and "_use_new_zipfile_serialization" not in message


def test_a_sparse_tensor_is_a_snapshot_error(saved):
    path = saved / "in" / "wq_a.pt"
    torch.save(torch.load(path, weights_only=True).to_sparse(), path)
    assert _refused(f"golden_data={saved}") == f"{path}: holds a torch.sparse_coo tensor; a snapshot file holds one dense tensor"


def test_save_into_a_folder_that_is_not_empty_is_refused_before_launch(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    p = run_cli(["layer=swa", "tp=2", "model=tiny", f"save_data={target}"], tmp_path, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"save_data={target} is not empty (it holds keep.txt)" in lines[0], p.stderr
    assert "save_overwrite=true" in lines[0] and not (tmp_path / "out" / "logs").exists()
    assert os.listdir(target) == ["keep.txt"]


def test_save_into_a_file_or_over_foreign_files_is_refused(tmp_path):
    file = tmp_path / "snap.pt"
    file.write_bytes(b"x")
    assert "is a file" in _refused("model=tiny", "tp=2", f"save_data={file}")
    folder = tmp_path / "mixed"
    (folder / "in").mkdir(parents=True)
    (folder / "thesis.tex").write_text("")
    message = _refused("model=tiny", "tp=2", f"save_data={folder}", "save_overwrite=true")
    assert "holds thesis.tex, which no snapshot holds" in message


def test_overwriting_a_snapshot_of_another_layer_leaves_none_of_its_files(tp_run, saved):
    run = tp_run(layer="hca", tp=2, model="tiny", save_data=str(saved), save_overwrite=True, golden_cache=None)
    assert run.passed, run
    specs = get_layer("hca").tensor_specs(_preflight("layer=hca", "model=tiny", "tp=2").case)
    held = {f"{sub}/{f[:-3]}" for sub in ("in", "out") for f in os.listdir(saved / sub)}
    assert held == {f"{sub}/{n}" for n, s in specs.items()
                    for sub in {"input": ["in"], "inout": ["in", "out"], "output": ["out"]}[s.kind.value]}
    assert json.loads((saved / "manifest.json").read_text())["layer"] == "hca"
    assert not [e for e in os.listdir(saved.parent) if e.startswith(".snap")]  # no building or old folder left
    assert tp_run(golden_data=str(saved)).passed
