"""The properties every layer of the registry holds, run for each one (a layer added to
`layers.registry.LAYERS` is covered here without an edit, but for its defects below).

Each layer's canonical case is what `python -m launcher layer=NAME model=tiny` runs; its
group of one rank (tp=1, ep=1 for MoE) is that case with a group size of 1. The layers are
reached through the registry and their `Layer` objects only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import pytest
import torch

from launcher.config.spec import run_spec
from launcher.verify.base import initial_key
from launcher.verify.build import build_comparator
from layers.contract.checks import PoolCheck
from layers.contract.config import ConfigError
from layers.contract.context import RankContext
from layers.contract.tensors import Kind
from layers.declared import declaration
from layers.registry import LAYERS, get_layer, validated
from launcher.store.snapshot_layer import kind_of

from .. import defects
from ..conftest import compose_config

# The defects of each layer that show on one rank (a replaced collective is the identity there:
# those FAIL on real ranks, tests/distributed and tests/e2e). A new layer lists its own.
DEFECTS = {
    "swa": (defects.SkipCacheWrite, defects.CacheWriteWrongSlot),
    "csa": (defects.CsaMissedCommit, defects.CsaStateWrongSlot, defects.CsaSentinelOverwritten,
            defects.CsaTopkOffByOne, defects.CacheWriteWrongSlot),
    "hca": (defects.HcaMissedCommit, defects.HcaPoolsWrongRows, defects.HcaWrongRopePosition,
            defects.CacheWriteWrongSlot),
    "moe": (defects.MoeDropsTheRoutingWeight,),
    "block": (defects.BlockRowsReordered, defects.BlockResidualBeforeAttention),
}

CPU = torch.device("cpu")


@functools.cache
def canonical_case(name: str):
    """The case the launcher runs for `layer=NAME model=tiny` (every other key its default)."""
    return run_spec(compose_config(f"layer={name}", "model=tiny"), "unused").case


# The case fields that size a layer's group (the block has both: attention TP groups of tp in
# a world of ep ranks).
GROUP_SIZES = ("tp", "ep")


def one_rank(case):
    fields = {f.name for f in dataclasses.fields(case)}
    return dataclasses.replace(case, **{k: 1 for k in GROUP_SIZES if k in fields})


def cloned(tensors):
    return {n: x.clone() for n, x in tensors.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dim() else t


def golden(layer, ctx: RankContext, tensors):
    """The layer's golden of one rank's tensors, as a launch computes it on that rank."""
    return layer.rank_golden(ctx, tensors)


def stacked_fixture(layer):
    """The layer's `stacked_inputs` (the whole group's inputs drawn at once), found through the
    module that defines the layer; None where its fixture draws rank by rank only."""
    module = sys.modules[type(layer).__module__]
    fixtures = [m for m in vars(module).values() if inspect.ismodule(m) and hasattr(m, "stacked_inputs")]
    return fixtures[0].stacked_inputs if fixtures else None


@functools.cache
def one_rank_golden(name: str):
    """A layer, its case on one rank, that rank's inputs and the golden of them (read only)."""
    layer = get_layer(name)
    case = one_rank(canonical_case(name))
    validated(case)
    inputs = layer.rank_inputs(case, 0)
    return layer, case, inputs, golden(layer, RankContext(case, 0, CPU), cloned(inputs))


@pytest.fixture(params=sorted(LAYERS))
def one_rank_run(request):
    return one_rank_golden(request.param)


def test_one_rank_forward_is_bitwise_the_golden(one_rank_run):
    layer, case, inputs, want = one_rank_run
    got = layer.forward(RankContext(case, 0, CPU), cloned(inputs))
    assert set(layer.compared_names(case)) <= set(got) & set(want)
    for name in layer.compared_names(case):
        assert torch.equal(bits(got[name]), bits(want[name])), name


def test_the_golden_moves_what_it_compares(one_rank_run):
    """An in-out left as it came in, or an output left zero, would pass a forward that skips it."""
    layer, case, inputs, want = one_rank_run
    for name in layer.compared_names(case):
        before = inputs.get(name)
        assert not torch.equal(want[name], before if before is not None else torch.zeros_like(want[name])), name


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_rank_slices_follow_the_specs_and_the_stacked_fixture(name):
    layer = get_layer(name)
    case = canonical_case(name)
    size = case.group_size
    assert size > 1, "the canonical case must have a group to slice"
    specs = layer.tensor_specs(case)
    held = {n for n, s in specs.items() if s.kind is not Kind.OUTPUT}
    ranks = [layer.rank_inputs(case, r) for r in range(size)]
    for r, mine in enumerate(ranks):
        assert set(mine) == held, r
        for n, x in mine.items():
            assert (tuple(x.shape), x.dtype) == (specs[n].shape, specs[n].dtype), (r, n)
    for n in layer.replicated_inputs:
        assert all(torch.equal(bits(x[n]), bits(ranks[0][n])) for x in ranks), n
    # Each rank holds its own tokens: a fixture that copied rank 0's would hide a mix-up of ranks.
    per_rank = [n for n in held if n not in layer.replicated_inputs and specs[n].shape and specs[n].dtype.is_floating_point]
    assert any(not torch.equal(ranks[0][n], ranks[1][n]) for n in per_rank)
    stacked_inputs = stacked_fixture(layer)
    if stacked_inputs is None:
        return
    stacked = stacked_inputs(case)
    assert set(stacked) == held
    for r, mine in enumerate(ranks):
        for n, x in mine.items():
            want = stacked[n] if not specs[n].shape else stacked[n][r]
            assert torch.equal(bits(x), bits(want)), (r, n)


@pytest.mark.parametrize("name", [n for n in sorted(LAYERS) if declaration(n) is not None])
def test_the_declaration_reads_the_case_back_from_the_tensor_shapes(name):
    """A snapshot of the layer is recognised as it by its tensor names, its group size is the
    declared key, and each declared model field read from the rank-stacked shapes is the model's."""
    case, layer, decl = canonical_case(name), get_layer(name), declaration(name)
    specs = layer.tensor_specs(case)
    assert kind_of(set(specs)) == decl and decl.group_key in GROUP_SIZES and hasattr(case, decl.group_key)
    group = getattr(case, decl.group_key)
    shapes = {}
    for n, spec in specs.items():
        stacked = spec.shape if spec.shape == () else (group, *spec.shape)
        shapes |= {f"{sub}/{n}": stacked for sub, kinds in (("in", (Kind.INPUT, Kind.INOUT)),
                                                            ("out", (Kind.INOUT, Kind.OUTPUT))) if spec.kind in kinds}
    fields: dict[str, int] = {}
    for dim in decl.dims:
        fields[dim.field] = dim.value(shapes[next(f for f in dim.files if f in shapes)], group, fields)
    assert fields == {f: getattr(case.model, f) for f in fields}
    assert all(f"in/{key}" in shapes and hasattr(case, key) for key in decl.scalars)


@pytest.mark.parametrize("name", [n for n in sorted(LAYERS) if declaration(n) is None])
def test_a_layer_without_a_snapshot_declaration_refuses_snapshots(name, tmp_path):
    """Its snapshots could not be recognised: saving or replaying one is a ConfigError."""
    for key in ("save_data", "golden_data"):
        with pytest.raises(ConfigError, match=key):
            run_spec(compose_config(f"layer={name}", "model=tiny", f"{key}={tmp_path}"), "unused")


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_checks_follow_the_validation_order(name):
    """One check per compared tensor, in the order the spec lists them (in-outs, then outputs)."""
    layer = get_layer(name)
    case = canonical_case(name)
    specs = layer.tensor_specs(case)
    compared = [n for n, s in specs.items() if s.kind is not Kind.INPUT]
    assert list(layer.compared_names(case)) == compared
    for check in layer.checks(case):
        if isinstance(check, PoolCheck):
            assert specs[check.mapping].kind is Kind.INPUT, check


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_validate_accepts_the_canonical_case_and_its_one_rank_group(name):
    case = canonical_case(name)
    assert validated(case) is get_layer(name)
    assert validated(one_rank(case)) is get_layer(name)


def bad_values(case):
    """Each key of the case (but the model and the seed) with a value no layer runs."""
    for field in dataclasses.fields(case):
        value = getattr(case, field.name)
        if field.name in ("model", "seed") or isinstance(value, bool):
            continue
        yield field.name, "no-such" if isinstance(value, str) else -1


BAD_KEYS = [(name, key, value) for name in sorted(LAYERS) for key, value in bad_values(canonical_case(name))]


@pytest.mark.parametrize("name, key, value", BAD_KEYS, ids=[f"{n}-{k}" for n, k, _ in BAD_KEYS])
def test_validate_refuses_each_bad_key_by_name(name, key, value):
    case = dataclasses.replace(canonical_case(name), **{key: value})
    with pytest.raises(ConfigError, match=f"{key}|{value}") as refused:
        validated(case)
    assert "\n" not in str(refused.value)


def test_every_layer_lists_its_defects():
    assert set(DEFECTS) == set(LAYERS)


DEFECT_CASES = [(name, d) for name in sorted(DEFECTS) for d in DEFECTS[name]]


@pytest.mark.parametrize("name, defect", DEFECT_CASES, ids=[d.__name__ for _, d in DEFECT_CASES])
def test_each_defect_fails_naming_tensor_and_rank(name, defect):
    """Judged as a run judges rank 0 of a group of one: some compared tensor FAILs, on rank 0
    (the golden, the layer's own stages, never takes the replaced stage)."""
    layer, case, inputs, want = one_rank_golden(name)
    got = defect()(RankContext(case, 0, CPU), cloned(inputs))
    context = {n: x[None] for n, x in inputs.items() if x.dim()}
    context.update({initial_key(n): inputs[n][None] for n in layer.compared_names(case) if n in inputs})
    context["local_t"] = torch.tensor(case.local_t, dtype=torch.int32)
    failed = {}
    for check in layer.checks(case):
        comparator = build_comparator(check, mapping_shape=(1, case.local_t), leading_rank_axis=True)
        actual, expected = got[check.output][None], want[check.output][None]
        verdict = comparator.evaluate(actual, expected, inputs=context, actual_outputs={check.output: actual},
                                      expected_outputs={check.output: expected})
        if not verdict.passed:
            failed[check.output] = [f.rank for f in verdict.per_rank if f.n_bad or f.stray_rows or f.unwritten_rows]
    assert failed, f"{defect.__name__} passes every check of {name}"
    assert all(ranks == [0] for ranks in failed.values()), failed
