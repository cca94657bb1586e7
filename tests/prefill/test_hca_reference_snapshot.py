"""The reference's own CP-HCA snapshot `prefill-hca-cp2-mini` (tests/data/reference: cp = 2, the
canonical zigzag case, the mini preset): our tables are its tables, our independent golden and
our CP stage list reproduce its outputs (every pool bitwise), a perturbed copy fails."""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import MINI
from layers.prefill import hca, hca_fixture, hca_layer
from layers.prefill.case import PrefillCase
from tests.one_pass_o_proj import use_one_pass_projection
from tests.prefill.judge import failures
from tests.prefill.reference_data import ReferencePrefill

CASE = PrefillCase("hca", MINI, 2, None)
LAYER = hca_layer.LAYER
POOLS = ("kv_cache", "cmp_kv", "compress_state")


@pytest.fixture(scope="module")
def snapshot():
    return ReferencePrefill(LAYER, CASE)


@pytest.fixture(scope="module")
def ours(snapshot):
    return snapshot.golden()


def test_the_snapshot_holds_the_layers_tensors(snapshot):
    """Every tensor the layer declares (besides which the reference keeps its own tables), in
    the shape the mini preset's case gives it: its 8-page raw-KV ring included."""
    held = {**snapshot.inputs, **snapshot.outputs}
    for name, spec in LAYER.tensor_specs(CASE).items():
        want = spec.stored_shape if spec.replicated else (CASE.cp, *spec.stored_shape)
        assert (tuple(held[name].shape), held[name].dtype) == (tuple(want), spec.dtype), name


def test_tables_are_the_references(snapshot):
    inp = snapshot.inputs
    for r in range(CASE.cp):
        for name, table in hca_fixture.rank_tables(CASE, r).items():
            assert torch.equal(table, inp[name] if name in LAYER.replicated_inputs else inp[name][r]), (r, name)


@pytest.mark.parametrize("one_pass", [False, True], ids=["golden", "one_pass_o_proj"])
def test_golden_reproduces_the_snapshot_bitwise(snapshot, two_threads, monkeypatch, one_pass):
    """Every pool bitwise; x_out a rounding off on a few tokens, and bitwise with the snapshot's
    one-pass o-projection swapped in (tests/one_pass_o_proj.py)."""
    if one_pass:
        use_one_pass_projection(monkeypatch)
    for r, (got, want) in enumerate(zip(snapshot.golden(), snapshot.reference_outputs())):
        for name in POOLS:
            assert torch.equal(got[name], want[name]), f"rank {r} {name}"
        diff = (got["x_out"] - want["x_out"]).abs().max().item()
        assert diff == 0 if one_pass else 0 < diff < 1e-3, f"rank {r} x_out: max |diff| {diff:.3g}"


def test_golden_and_cp_group_reproduce_the_reference(snapshot, ours):
    assert snapshot.group_failures((hca.reference_checks(), hca.default_checks()), ours) == []


def test_perturbed_snapshot_fails(snapshot, ours):
    expected = snapshot.reference_outputs()
    expected[1]["x_out"] = expected[1]["x_out"].clone()
    expected[1]["x_out"][:64] *= 1.05
    written = expected[0]["cmp_kv"].flatten(0, 2).abs().sum(-1) > 0  # the step's compressed rows
    expected[0]["cmp_kv"] = expected[0]["cmp_kv"].clone()
    expected[0]["cmp_kv"].flatten(0, 2)[written] += 0.5
    assert failures(hca.reference_checks(), ours, expected) == [(0, "cmp_kv"), (1, "x_out")]
