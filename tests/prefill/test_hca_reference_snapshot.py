"""The reference's own CP-HCA snapshot `prefill-hca-cp2-mini` (tests/data/reference: cp = 2, the
canonical zigzag case, the mini preset): our tables are its tables, our independent golden and
our CP stage list reproduce its outputs (every pool bitwise), a perturbed copy fails."""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import MINI
from layers.prefill import hca, hca_fixture, hca_layer
from layers.prefill.case import PrefillCase
from tests.conftest import reference_snapshot
from tests.one_pass_o_proj import use_one_pass_projection
from tests.prefill.group import run_group
from tests.prefill.judge import failures

FOLDER = reference_snapshot("prefill-hca")
CASE = PrefillCase("hca", MINI, 2, None)
LAYER = hca_layer.LAYER
POOLS = ("kv_cache", "cmp_kv", "compress_state")


def _load(sub):
    return {p.stem: torch.load(p, weights_only=True) for p in sorted((FOLDER / sub).glob("*.pt"))}


@pytest.fixture(scope="module")
def snapshot():
    return _load("in"), _load("out")


def _reference_outputs(out):
    return [{n: out[n][r].flatten(0, 2) if n == "x_out" else out[n][r] for n in hca_layer.COMPARED}
            for r in range(CASE.cp)]


def _ours(inp):
    got = LAYER.golden(CASE, {n: t.clone() for n, t in inp.items()})
    return [{n: got[n][r] for n in hca_layer.COMPARED} for r in range(CASE.cp)]


@pytest.fixture(scope="module")
def ours(snapshot):
    return _ours(snapshot[0])


def test_the_snapshot_holds_the_layers_tensors(snapshot):
    """Every tensor the layer declares (besides which the reference keeps its own tables), in
    the shape the mini preset's case gives it: its 8-page raw-KV ring included."""
    held = {**snapshot[0], **snapshot[1]}
    for name, spec in LAYER.tensor_specs(CASE).items():
        want = spec.stored_shape if spec.replicated else (CASE.cp, *spec.stored_shape)
        assert (tuple(held[name].shape), held[name].dtype) == (tuple(want), spec.dtype), name


def test_tables_are_the_references(snapshot):
    inp, _ = snapshot
    for r in range(CASE.cp):
        for name, table in hca_fixture.rank_tables(CASE, r).items():
            assert torch.equal(table, inp[name] if name in LAYER.replicated_inputs else inp[name][r]), (r, name)


@pytest.mark.parametrize("one_pass", [False, True], ids=["golden", "one_pass_o_proj"])
def test_golden_reproduces_the_snapshot_bitwise(snapshot, two_threads, monkeypatch, one_pass):
    """Every pool bitwise; x_out a rounding off on a few tokens, and bitwise with the snapshot's
    one-pass o-projection swapped in (tests/one_pass_o_proj.py)."""
    if one_pass:
        use_one_pass_projection(monkeypatch)
    inp, out = snapshot
    for r, (got, want) in enumerate(zip(_ours(inp), _reference_outputs(out))):
        for name in POOLS:
            assert torch.equal(got[name], want[name]), f"rank {r} {name}"
        diff = (got["x_out"] - want["x_out"]).abs().max().item()
        assert diff == 0 if one_pass else 0 < diff < 1e-3, f"rank {r} x_out: max |diff| {diff:.3g}"


def test_golden_and_cp_group_reproduce_the_reference(snapshot, ours):
    inp, out = snapshot
    expected = _reference_outputs(out)
    assert failures(hca.reference_checks(), ours, expected) == []
    assert failures(hca.default_checks(), ours, expected) == []
    group = run_group(CASE, [LAYER.of_rank(inp, r) for r in range(CASE.cp)])
    assert failures(hca.reference_checks(), group, expected) == []
    assert failures(hca.default_checks(), group, expected) == []


def test_perturbed_snapshot_fails(snapshot, ours):
    _, out = snapshot
    expected = _reference_outputs(out)
    expected[1]["x_out"] = expected[1]["x_out"].clone()
    expected[1]["x_out"][:64] *= 1.05
    written = expected[0]["cmp_kv"].flatten(0, 2).abs().sum(-1) > 0  # the step's compressed rows
    expected[0]["cmp_kv"] = expected[0]["cmp_kv"].clone()
    expected[0]["cmp_kv"].flatten(0, 2)[written] += 0.5
    assert failures(hca.reference_checks(), ours, expected) == [(0, "cmp_kv"), (1, "x_out")]
