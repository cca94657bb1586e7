"""The golden cache trusts only whole entries: a tampered, damaged or foreign entry is a miss.

Each test fills a cache with a correct run, damages its entries (goldens and inputs) the way a
user, a disk or an older version could, and checks the next run's verdict and whether it read or
rewrote them. Inputs read back are bit for bit a fresh draw's, and give a fresh draw's verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.config.spec import run_spec
from launcher.run.groups import GroupLayout
from launcher.run.rank_data import rank_inputs
from launcher.run.worker import node_ranks
from launcher.store import golden_cache
from layers.contract.tensors import Kind, TensorSpec, tensor_sha256
from layers.registry import get_layer as layer_of

SWA = dict(layer="swa", tp=2, model="tiny")


def _entries(cache: Path, kind: str = "golden") -> dict[int | None, Path]:
    """The cache's entry files of `kind` by rank (one case per cache here): "golden", "inputs"
    (a rank's own) or "group" (the inputs every rank holds alike, under the key None)."""
    found = {}
    for path in cache.glob("*.pt"):
        if "-group-inputs-" in path.name:
            entry_kind, rank = "group", None
        else:
            entry_kind = "inputs" if "-inputs-" in path.name else "golden"
            rank = int(path.name.split("-r")[1].split("-")[0])
        if entry_kind == kind:
            found[rank] = path
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
        x_out = entry["tensors"]["x_out"]
        x_out[:seq] = x_out[:seq] * 1.5 + 0.25

    _edit(_entries(cache)[1], perturb)
    run = tp_run(**SWA, golden_cache=str(cache), impl="tests.defects.PerturbRankTokens")
    assert run.exit_code == 1, run
    assert run.result["golden_cache_hits"] == [0]  # rank 1's entry was recomputed
    assert run.verdict("x_out")["passed"] is False


# An entry of each kind, names of tensors it holds (an output or input, an in-out or input),
# and the ranks that may still read theirs when rank 0's (or the group's) is damaged: rank 1
# may find the group's entry already rewritten by rank 0 of the same run.
ENTRY_NAMES = {"golden": ("x_out", "kv_cache"), "inputs": ("x_hc", "kv_cache"), "group": ("wq_a", "wkv")}
HITS = {"golden": "golden_cache_hits", "inputs": "input_cache_hits", "group": "input_cache_hits"}
STILL_HIT = {"golden": ([1],), "inputs": ([1],), "group": ([], [1])}


@pytest.mark.parametrize("kind", ["golden", "inputs", "group"])
@pytest.mark.parametrize("damage", ["flipped_bytes", "wrong_shape", "missing_key", "malformed_tensors", "garbage"])
def test_a_damaged_entry_is_recomputed_and_replaced(tp_run, tmp_path, damage, kind):
    cache = tmp_path / "cache"
    assert tp_run(**SWA, golden_cache=str(cache)).passed
    path = _entries(cache, kind)[None if kind == "group" else 0]
    reshaped, dropped = ENTRY_NAMES[kind]
    if damage == "flipped_bytes":
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 4000] = bytes(b ^ 0x5A for b in data[middle : middle + 4000])
        path.write_bytes(bytes(data))
    elif damage == "wrong_shape":
        _edit(path, lambda e: e["tensors"].__setitem__(reshaped, e["tensors"][reshaped][:8].clone()))
    elif damage == "missing_key":
        _edit(path, lambda e: e["tensors"].pop(dropped))
    elif damage == "malformed_tensors":
        _edit(path, lambda e: e.__setitem__("tensors", [1, 2, 3]))
    else:
        path.write_bytes(b"not a torch file")
    second = tp_run(**SWA, golden_cache=str(cache))
    assert second.passed, second
    assert second.result[HITS[kind]] in STILL_HIT[kind]
    third = tp_run(**SWA, golden_cache=str(cache))
    assert third.passed and third.result[HITS[kind]] == [0, 1]  # the entry was rewritten


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
    _edit(path, lambda e: e["tensors"]["x_out"].add_(1))
    assert golden_cache.load(str(tmp_path), ident, specs) is None


def test_the_source_hash_covers_nested_packages(tmp_path):
    (tmp_path / "components").mkdir()
    nested = tmp_path / "components" / "math.py"
    nested.write_text("x = 1\n")
    (tmp_path / "top.py").write_text("y = 2\n")
    before = golden_cache.source_hash(tmp_path)
    nested.write_text("x = 2\n")
    assert golden_cache.source_hash(tmp_path) != before


CASES = {"swa": dict(layer="swa", tp=2, model="tiny"), "csa": dict(layer="csa", tp=2, model="tiny"),
         "hca": dict(layer="hca", tp=2, model="tiny"),
         "moe": dict(layer="moe", ep=2, model="tiny", layer_id=4, num_tokens=96)}


@pytest.mark.parametrize("name", CASES)
def test_inputs_read_from_the_cache_are_a_fresh_draw_bit_for_bit(tmp_path, name):
    overrides = [f"{k}={v}" for k, v in CASES[name].items()] + [f"golden_cache={tmp_path}"]
    with initialize_config_module(config_module="configs", version_base=None):
        spec = run_spec(compose(config_name="config", overrides=overrides), str(tmp_path / "out"))
    layer, case = spec.layer, spec.case
    pure = layer.names_of(case, Kind.INPUT)
    for rank in range(case.group_size):
        stored = rank_inputs(spec, layer, case, rank, pure, stores_group=rank == 0)
        read = rank_inputs(spec, layer, case, rank, pure, stores_group=False)
        fresh = layer.rank_inputs(case, rank)
        assert (stored.cache, read.cache) == (None, "hit")
        assert set(read.tensors) == set(fresh)
        for n, t in fresh.items():
            got = read.tensors[n]
            assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride(), n
            assert torch.equal(got.view(torch.uint8) if got.dim() else got, t.view(torch.uint8) if t.dim() else t), n
        assert read.sha256 == {n: tensor_sha256(fresh[n]) for n in pure}


def _verdicts(run) -> str:
    return json.dumps([run.result["verdicts"], run.result.get("integrity")], sort_keys=True)


@pytest.mark.parametrize("impl", ["layers.tp.TorchTP", "tests.defects.CsaMissedCommit"])
def test_a_run_on_cached_inputs_has_the_verdicts_of_a_run_on_drawn_ones(tp_run, tmp_path, impl):
    cache = str(tmp_path / "cache")
    cold = tp_run(**CASES["csa"], golden_cache=None, impl=impl)
    first = tp_run(**CASES["csa"], golden_cache=cache, impl=impl)
    warm = tp_run(**CASES["csa"], golden_cache=cache, impl=impl)
    assert first.result["input_cache_hits"] == [] and warm.result["input_cache_hits"] == [0, 1], warm
    assert "inputs from the golden cache on ranks [0, 1]" in warm.report
    assert cold.exit_code == first.exit_code == warm.exit_code == (0 if impl == "layers.tp.TorchTP" else 1)
    assert _verdicts(cold) == _verdicts(first) == _verdicts(warm)


def test_an_impl_that_writes_into_its_inputs_leaves_the_cached_inputs_as_drawn(tp_run, tmp_path):
    cache = str(tmp_path / "cache")
    assert tp_run(**SWA, golden_cache=cache).passed  # the second run's inputs are read from the cache
    broken = tp_run(**SWA, golden_cache=cache, impl="tests.defects.CorruptPureInputs")
    assert broken.exit_code == 2, broken
    assert "impl changed its pure input(s) wq_a" in broken.report  # caught against the entry's digests
    again = tp_run(**SWA, golden_cache=cache)
    assert again.passed and again.result["input_cache_hits"] == [0, 1], again


def test_one_group_entry_holds_what_every_rank_holds_alike(tp_run, tmp_path):
    cache = tmp_path / "cache"
    assert tp_run(**CASES["csa"], golden_cache=str(cache)).passed
    group, own = _entries(cache, "group"), _entries(cache, "inputs")
    assert list(group) == [None] and sorted(own) == [0, 1]
    shared = torch.load(group[None], weights_only=True)["tensors"]
    assert set(shared) == layer_of("csa").replicated_inputs
    for path in own.values():
        assert not set(torch.load(path, weights_only=True)["tensors"]) & set(shared)
    # The replicated weights and pools are the bulk of a rank's inputs.
    assert group[None].stat().st_size > sum(p.stat().st_size for p in own.values())


@pytest.mark.parametrize("name, overrides", [
    ("swa", ["layer=swa", "tp=4"]), ("swa", ["layer=swa", "tp=2", "+starts=mixed"]),
    ("csa", ["layer=csa", "tp=4"]), ("csa", ["layer=csa", "tp=2", "dp=2"]),
    ("csa", ["layer=csa", "tp=2", "+starts=mixed"]),
    ("hca", ["layer=hca", "tp=4"]), ("hca", ["layer=hca", "tp=2", "+starts=mixed"]),
    ("hca", ["layer=hca", "tp=2", "dp=2"]),
    ("moe", ["layer=moe", "ep=4", "layer_id=4", "num_tokens=96"]),
    ("moe", ["layer=moe", "ep=2", "dp=2", "layer_id=4", "num_tokens=96"]),
])
def test_the_replicated_inputs_a_layer_declares_are_alike_on_every_rank(name, overrides):
    """`Layer.replicated_inputs` is a promise the golden cache stores once per group on: a name
    wrongly in it would hand every rank the first rank's tensor under a valid digest."""
    with initialize_config_module(config_module="configs", version_base=None):
        spec = run_spec(compose(config_name="config", overrides=[*overrides, "model=tiny"]), "/x")
    layer = spec.layer
    for group in range(spec.dp):
        case = spec.case.of_group(group)
        inputs = [layer.rank_inputs(case, r) for r in range(case.group_size)]
        assert layer.replicated_inputs <= set(inputs[0]), name
        for n in layer.replicated_inputs:
            assert all(torch.equal(inputs[0][n], x[n]) for x in inputs[1:]), (name, n)
        own = [t for n, t in inputs[0].items() if n not in layer.replicated_inputs]
        shared = [t for n, t in inputs[0].items() if n in layer.replicated_inputs]
        # Stored apart, they must not alias: an in-place write to one would reach the other.
        assert not {t.untyped_storage().data_ptr() for t in own} & {t.untyped_storage().data_ptr() for t in shared}


def test_one_rank_per_group_and_node_writes_the_groups_entry(monkeypatch):
    # Two nodes of four ranks: tp=4 dp=2 puts a group on each node; tp=8 spans both.
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    node = node_ranks(None)
    assert node == range(4, 8)
    writers = {(dp, tp): [r for r in range(8) if GroupLayout(dp, tp, r).leads_group_on(node)]
               for dp, tp in ((2, 4), (1, 8), (4, 2))}
    assert writers == {(2, 4): [4], (1, 8): [4], (4, 2): [4, 6]}
