"""The reference's own CP-SWA snapshot `prefill-swa-cp2-mini` (tests/data/reference: cp = 2, the
canonical zigzag case, the mini preset's 8-page raw-KV ring): our tables are its tables, our
independent golden and our CP stage list both reproduce its outputs, a perturbed copy fails.
(The older small-dims one at the reference's 128-page pool is replayed through the launcher,
where it is present: tests/e2e/test_prefill_e2e.py.)
"""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import MINI
from layers.prefill import fixture, golden, layer, swa, tables
from layers.prefill.case import PrefillCase
from tests.conftest import reference_snapshot
from tests.one_pass_o_proj import use_one_pass_projection
from tests.prefill.group import run_group
from tests.prefill.judge import failures

FOLDER = reference_snapshot("prefill-swa")


def _load(sub):
    return {p.stem: torch.load(p, weights_only=True) for p in sorted((FOLDER / sub).glob("*.pt"))}


@pytest.fixture(scope="module")
def snapshot():
    """(case, in/, out/); the case's model is the preset that replays it."""
    return PrefillCase("swa", MINI, 2, None), _load("in"), _load("out")


def test_tables_are_the_references(snapshot):
    case, inp, _ = snapshot
    positions, _ = tables.query_positions(case)
    seg_src, row_src, slot = tables.final_window(case)
    assert torch.equal(positions, inp["query_position_ids"])
    assert torch.equal(tables.reverse_index(case), inp["reverse_index"])
    assert torch.equal(tables.owner_rank_table(case), inp["owner_rank_table"])
    assert torch.equal(seg_src, inp["final_win_seg_src"])
    assert torch.equal(row_src, inp["final_win_row_src"])
    assert torch.equal(slot, inp["final_slot_mapping"])
    assert torch.equal(tables.overlay_active_lengths(case), inp["overlay_active_lengths"])
    for r in range(case.cp):
        mine = fixture.rank_tables(case, r)
        for name, table in mine.items():
            assert torch.equal(table, inp[name] if name in layer.LAYER.replicated_inputs else inp[name][r]), name


def test_the_ring_is_the_presets(snapshot):
    """The raw-KV ring the snapshot holds is the one its preset's case declares."""
    case, inp, _ = snapshot
    assert tuple(inp["kv_cache"].shape[1:]) == layer.LAYER.tensor_specs(case)["kv_cache"].shape


def _ours(case, inp):
    """Our independent golden on the snapshot's inputs, every rank."""
    prompt = golden.prompt_of(case, inp["x_hc"])
    return layer.golden(case, range(case.cp), prompt, layer.from_reference(inp, 0))


@pytest.fixture(scope="module")
def ours(snapshot):
    case, inp, _ = snapshot
    return _ours(case, inp)


def _reference_outputs(case, out):
    return [{"kv_cache": out["kv_cache"][r], "x_out": out["x_out"][r].flatten(0, 2)} for r in range(case.cp)]


def test_golden_and_cp_group_reproduce_the_reference(snapshot, ours):
    case, inp, out = snapshot
    expected = _reference_outputs(case, out)
    assert failures(swa.reference_checks(), ours, expected) == []
    assert failures(swa.default_checks(), ours, expected) == []
    group = run_group(case, [layer.from_reference(inp, r) for r in range(case.cp)])
    assert failures(swa.reference_checks(), group, expected) == []


@pytest.mark.parametrize("one_pass", [False, True], ids=["golden", "one_pass_o_proj"])
def test_golden_reproduces_the_shipped_snapshot_bitwise(two_threads, monkeypatch, one_pass):
    """kv_cache bitwise; x_out a rounding off on a few tokens, and bitwise with the snapshot's
    one-pass o-projection swapped in (tests/one_pass_o_proj.py), as for the decode snapshots."""
    if one_pass:
        use_one_pass_projection(monkeypatch)
    case, inp, out = PrefillCase("swa", MINI, 2, None), _load("in"), _load("out")
    for r, (got, want) in enumerate(zip(_ours(case, inp), _reference_outputs(case, out))):
        assert torch.equal(got["kv_cache"], want["kv_cache"]), f"rank {r} kv_cache"
        diff = (got["x_out"] - want["x_out"]).abs().max().item()
        # A slip in the layer's own math moves x_out by far more than the projection's K order.
        assert diff == 0 if one_pass else 0 < diff < 1e-3, f"rank {r} x_out: max |diff| {diff:.3g}"


def test_perturbed_snapshot_fails(snapshot, ours):
    case, inp, out = snapshot
    hd = case.model.head_dim
    expected = _reference_outputs(case, out)
    expected[1]["x_out"] = expected[1]["x_out"].clone()
    expected[1]["x_out"][:64] *= 1.05
    expected[0]["kv_cache"] = expected[0]["kv_cache"].clone()
    final_rows = expected[0]["kv_cache"].view(-1, hd)[inp["final_slot_mapping"].long()]
    expected[0]["kv_cache"].view(-1, hd)[inp["final_slot_mapping"].long()] = final_rows + 0.5
    assert failures(swa.reference_checks(), ours, expected) == [(0, "kv_cache"), (1, "x_out")]


def test_default_profile_catches_one_wrong_cache_row(snapshot, ours):
    """The reference's kv_cache budget (0.5 % of the pool) lets a whole wrong row through; ours does not."""
    case, inp, out = snapshot
    expected = _reference_outputs(case, out)
    expected[0]["kv_cache"] = expected[0]["kv_cache"].clone()
    expected[0]["kv_cache"].view(-1, case.model.head_dim)[int(inp["final_slot_mapping"][5])] += 0.5
    assert failures(swa.reference_checks(), ours, expected) == []
    assert failures(swa.default_checks(), ours, expected) == [(0, "kv_cache")]
