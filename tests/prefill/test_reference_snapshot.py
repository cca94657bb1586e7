"""The reference's own CP-SWA snapshot (cp = 2, small dims): our tables are its tables, our
independent golden and our CP stage list both reproduce its outputs, a perturbed copy fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layers.contract.config import SMALL
from layers.prefill import fixture, golden, layer, swa, tables
from layers.prefill.case import PrefillCase
from tests.prefill.group import run_group
from tests.prefill.judge import failures

SNAPSHOT = Path(__file__).resolve().parents[2] / "../shared/peer/prefill-swa-cp2-small"
pytestmark = pytest.mark.skipif(not SNAPSHOT.is_dir(), reason="no ../shared/peer (reference snapshots) in this clone")
CASE = PrefillCase("swa", SMALL, 2, None)


@pytest.fixture(scope="module")
def snapshot():
    load = lambda d: {p.stem: torch.load(p, weights_only=True) for p in (SNAPSHOT / d).glob("*.pt")}  # noqa: E731
    return load("in"), load("out")


def test_tables_are_the_references(snapshot):
    inp, _ = snapshot
    positions, _ = tables.query_positions(CASE)
    seg_src, row_src, slot = tables.final_window(CASE)
    assert torch.equal(positions, inp["query_position_ids"])
    assert torch.equal(tables.reverse_index(CASE), inp["reverse_index"])
    assert torch.equal(tables.owner_rank_table(CASE), inp["owner_rank_table"])
    assert torch.equal(seg_src, inp["final_win_seg_src"])
    assert torch.equal(row_src, inp["final_win_row_src"])
    assert torch.equal(slot, inp["final_slot_mapping"])
    assert torch.equal(tables.overlay_active_lengths(CASE), inp["overlay_active_lengths"])
    for r in range(CASE.cp):
        mine = fixture.rank_tables(CASE, r)
        for name, table in mine.items():
            assert torch.equal(table, inp[name] if name in layer.LAYER.replicated_inputs else inp[name][r]), name


@pytest.fixture(scope="module")
def ours(snapshot):
    """Our independent golden on the snapshot's inputs, every rank."""
    inp, _ = snapshot
    prompt = golden.prompt_of(CASE, inp["x_hc"])
    return layer.golden(CASE, range(CASE.cp), prompt, layer.from_reference(inp, 0))


def _reference_outputs(out):
    return [{"kv_cache": out["kv_cache"][r], "x_out": out["x_out"][r].flatten(0, 2)} for r in range(CASE.cp)]


def test_golden_and_cp_group_reproduce_the_reference(snapshot, ours):
    inp, out = snapshot
    expected = _reference_outputs(out)
    assert failures(swa.reference_checks(), ours, expected) == []
    assert failures(swa.default_checks(), ours, expected) == []
    group = run_group(CASE, [layer.from_reference(inp, r) for r in range(CASE.cp)])
    assert failures(swa.reference_checks(), group, expected) == []


def test_perturbed_snapshot_fails(snapshot, ours):
    inp, out = snapshot
    expected = _reference_outputs(out)
    expected[1]["x_out"] = expected[1]["x_out"].clone()
    expected[1]["x_out"][:64] *= 1.05
    expected[0]["kv_cache"] = expected[0]["kv_cache"].clone()
    final_rows = expected[0]["kv_cache"].view(-1, SMALL.head_dim)[inp["final_slot_mapping"].long()]
    expected[0]["kv_cache"].view(-1, SMALL.head_dim)[inp["final_slot_mapping"].long()] = final_rows + 0.5
    assert failures(swa.reference_checks(), ours, expected) == [(0, "kv_cache"), (1, "x_out")]


def test_default_profile_catches_one_wrong_cache_row(snapshot, ours):
    """The reference's kv_cache budget (0.5 % of the pool) lets a whole wrong row through; ours does not."""
    inp, out = snapshot
    expected = _reference_outputs(out)
    expected[0]["kv_cache"] = expected[0]["kv_cache"].clone()
    expected[0]["kv_cache"].view(-1, SMALL.head_dim)[int(inp["final_slot_mapping"][5])] += 0.5
    assert failures(swa.reference_checks(), ours, expected) == []
    assert failures(swa.default_checks(), ours, expected) == [(0, "kv_cache")]
