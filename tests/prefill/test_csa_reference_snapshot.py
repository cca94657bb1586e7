"""The reference's own CP-CSA snapshot `prefill-csa-cp2-mini` (tests/data/reference: cp = 2, the
canonical zigzag case, the mini preset): our tables are its tables, our independent golden and
our CP stage list pass its comparators and ours on its outputs, a perturbed copy fails."""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import MINI
from layers.prefill import csa, csa_fixture, csa_layer, csa_tables
from layers.prefill.case import PrefillCase
from tests.prefill.judge import failures
from tests.prefill.reference_data import ReferencePrefill

CASE = PrefillCase("csa", MINI, 2, None)
LAYER = csa_layer.LAYER
BITWISE_POOLS = ("kv_cache", "idx_kv_cache", "idx_kv_scale", "compress_state", "inner_compress_state")


@pytest.fixture(scope="module")
def snapshot():
    return ReferencePrefill(LAYER, CASE)


@pytest.fixture(scope="module")
def ours(snapshot, two_threads):
    return snapshot.golden()


def test_the_snapshot_holds_the_layers_tensors(snapshot):
    held = {**snapshot.inputs, **snapshot.outputs}
    for name, spec in LAYER.tensor_specs(CASE).items():
        want = spec.stored_shape if spec.replicated else (CASE.cp, *spec.stored_shape)
        assert (tuple(held[name].shape), held[name].dtype) == (tuple(want), spec.dtype), name


def test_tables_are_the_references_but_the_inner_state_table(snapshot):
    """Ours but one are the reference's; the inner compressor state's maps block b to page
    (7·b + 5) mod 65 where the reference's, like the main state's, maps it to b mod 65, so that a
    row written through the main state's table lands in the wrong page."""
    for r in range(CASE.cp):
        for name, table in csa_fixture.rank_tables(CASE, r).items():
            theirs = snapshot.inputs[name] if name in LAYER.replicated_inputs else snapshot.inputs[name][r]
            if name == "inner_compress_state_block_table":
                assert torch.equal(table, (7 * theirs + 5) % csa_tables.STATE_PHYSICAL_BLOCKS), (r, name)
            else:
                assert torch.equal(table, theirs), (r, name)


def test_golden_is_the_references_but_for_a_few_roundings(snapshot, ours):
    """Both compressor states, the raw KV and the indexer pool bitwise; three compressed-KV
    elements a rounding off (at most 1e-6: the pooled sum's order), which every query that
    selects their rows carries into x_out, well inside the comparators."""
    for r, (got, want) in enumerate(zip(ours, snapshot.reference_outputs())):
        for name in BITWISE_POOLS:
            assert torch.equal(got[name], want[name]), f"rank {r} {name}"
        diff = (got["cmp_kv"].float() - want["cmp_kv"].float()).abs()
        assert int((diff > 0).sum()) <= 8 and diff.max().item() <= 1e-6, f"rank {r} cmp_kv"
        assert (got["x_out"] - want["x_out"]).abs().max().item() < 1e-3, f"rank {r} x_out"


def test_golden_and_cp_group_pass_on_the_references_outputs(snapshot, ours):
    assert snapshot.group_failures((csa.reference_checks(), csa.default_checks()), ours) == []


def test_perturbed_snapshot_fails(snapshot, ours):
    expected = snapshot.reference_outputs()
    expected[1]["x_out"] = expected[1]["x_out"].clone()
    expected[1]["x_out"][:64] *= 1.05
    expected[0]["idx_kv_cache"] = expected[0]["idx_kv_cache"].clone()
    written = expected[0]["idx_kv_cache"].flatten(0, 2).abs().sum(-1) > 0  # the step's indexer rows
    expected[0]["idx_kv_cache"].flatten(0, 2)[written] += 3
    assert failures(csa.default_checks(), ours, expected) == [(0, "idx_kv_cache"), (1, "x_out")]
