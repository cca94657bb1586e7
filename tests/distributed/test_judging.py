"""Each compared tensor judged on a rank of its own (`launcher.run.judging`): the sends to the
judges on real gloo ranks, the plan, what a check reads, and the verdicts put back in order."""

from __future__ import annotations

import json
import random

import pytest
import torch

from layers.contract.case import Case
from layers.contract.checks import PoolCheck, RelDiffCheck
from layers.contract.config import TINY
from layers.contract.context import RankContext
from layers.contract.tensors import Kind, TensorSpec
from layers.distributed import wire
from layers.registry import get_scope, validated

from launcher.config.tolerance import read_tolerances
from launcher.run import judging
from launcher.run.rank_data import golden_outputs
from launcher.verify.base import initial_key

from ..rank_harness import run_ranks

# (shape, dtype, destination rank): two messages from every rank to rank 2 of different sizes,
# a 0-dim tensor, and dtypes whose bytes a cast would change.
SENDS = [((3, 5), torch.bfloat16, 2), ((7,), torch.int8, 0), ((2, 2, 2), torch.float32, 1),
         ((4,), torch.bool, 2), ((), torch.int32, 0), ((6, 1), torch.float32, 2)]


def _shard(rank: int, index: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index)
    values = torch.randn(shape, generator=g) * 100
    return values > 0 if dtype is torch.bool else values.to(dtype)


def _gather_each_job(rank: int, world: int):
    sends = [(_shard(rank, i, shape, dtype), dst) for i, (shape, dtype, dst) in enumerate(SENDS)]
    return wire.gather_each(sends, rank, world)


def test_gather_each_stacks_every_tensor_on_its_own_rank():
    world = 3
    got = run_ranks(world, _gather_each_job)
    for rank in range(world):
        for i, (shape, dtype, dst) in enumerate(SENDS):
            if dst != rank:
                assert got[rank][i] is None
                continue
            want = torch.stack([_shard(r, i, shape, dtype) for r in range(world)])
            assert got[rank][i].dtype == dtype and got[rank][i].shape == want.shape
            assert torch.equal(got[rank][i].view(torch.uint8), want.view(torch.uint8)), (rank, i)


def _spec(numel: int) -> TensorSpec:
    return TensorSpec((numel,), torch.float32, Kind.INOUT)


def test_the_plan_deals_the_largest_checks_first_to_the_least_loaded_rank():
    specs = {"a": _spec(10), "b": _spec(40), "c": _spec(30), "d": _spec(5), "map": TensorSpec((8,), torch.int64, Kind.INPUT)}
    checks = [RelDiffCheck("a", 1e-3, 1e-3, 1.0), PoolCheck("b", "map", 1, 1e-4, 1e-2),
              RelDiffCheck("c", 1e-3, 1e-3, 1.0), RelDiffCheck("d", 1e-3, 1e-3, 1.0)]
    context = {"map", initial_key("b")}
    plan = judging.plan(checks, context, specs, references=1, world=3)
    assert [a.index for a in plan] == [0, 1, 2, 3] and [a.output for a in plan] == ["a", "b", "c", "d"]
    assert plan[1].context == ("map", initial_key("b"))  # b: 2*160 + 64 + 160 bytes, the largest
    assert [a.judge for a in plan] == [2, 0, 1, 2]  # then c (240) to rank 1, a (80) and d (40) to rank 2
    assert {a.judge for a in judging.plan(checks, context, specs, references=2, world=1)} == {0}


def test_collect_puts_every_verdict_back_in_check_order():
    judged = {0: [], 1: [], 2: []}
    for g in range(2):
        for source in ("snapshot", "golden"):
            for index in range(4):
                judged[(index + g) % 3].append((g, source, index, {"tensor": f"t{index}", "g": g, "source": source},
                                                 [{"check": f"t{index}-{k}"} for k in range(2)]))
    for answers in judged.values():
        random.Random(0).shuffle(answers)
    comparisons, integrity = judging.collect([judged[r] for r in range(3)], 2, ["snapshot", "golden"], True)
    for g in range(2):
        assert list(comparisons[g]) == ["snapshot", "golden"]
        for source in ("snapshot", "golden"):
            assert comparisons[g][source] == [{"tensor": f"t{i}", "g": g, "source": source} for i in range(4)]
            assert integrity[g][source] == [{"check": f"t{i}-{k}"} for i in range(4) for k in range(2)]
    assert judging.collect([judged[r] for r in range(3)], 2, ["snapshot", "golden"], False)[1] == [None, None]


def _stacked_case(layer_name: str, scope: str):
    """Every rank's golden, an actual with stray and wrong values, and the context, stacked."""
    case = Case(layer_name, TINY, 2, 16, 20260819)
    layer = validated(case) if scope == "full" else get_scope(layer_name, scope)
    compared = layer.compared_names(case)
    specs = layer.tensor_specs(case)
    inout = [n for n in compared if specs[n].kind is Kind.INOUT]
    mappings = sorted({c.mapping for c in layer.checks(case) if isinstance(c, PoolCheck)})
    golden, context = [], []
    for rank in range(case.tp):
        if layer.sharded_o_weights:
            inputs, wo_full = layer.rank_inputs_and_full_o(case, rank)
        else:
            inputs, wo_full = layer.rank_inputs(case, rank), None
        golden.append(golden_outputs(layer, RankContext(case=case, rank=rank, device=torch.device("cpu")), inputs, wo_full))
        context.append({**{m: inputs[m] for m in mappings}, **{initial_key(n): inputs[n].clone() for n in inout}})
    stack = lambda per_rank: {n: torch.stack([d[n] for d in per_rank]) for n in per_rank[0]}  # noqa: E731
    golden, context = stack(golden), stack(context)
    actual = {}
    g = torch.Generator().manual_seed(7)
    for name, t in golden.items():
        wrong = t.clone()
        flat = wrong.view(-1)
        picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        if wrong.is_floating_point():
            flat[picks] = flat[picks] + 3.0
            flat[picks[:1]] = float("nan")
        else:
            flat[picks] = flat[picks] ^ 1 if wrong.dtype is not torch.bool else ~flat[picks]
        actual[name] = wrong
    return case, layer, actual, golden, context


@pytest.mark.parametrize("layer_name, scope", [("swa", "full"), ("csa", "full"), ("hca", "full"), ("swa", "output"),
                                               ("csa", "collectives"), ("hca", "tp1")])
def test_a_check_judged_with_its_own_tensors_alone_gets_the_same_verdict(layer_name, scope):
    # A judge holds a check's own tensors and the context `context_of` names, nothing else:
    # whatever else the check read would change its verdict (or raise) here.
    case, layer, actual, golden, context = _stacked_case(layer_name, scope)
    tolerances = read_tolerances(None, case, frozenset())
    failed = 0
    for check in layer.checks(case):
        everything = judging.judge_check(case, tolerances, check, actual, golden, context, True)
        own = {n: context[n] for n in judging.context_of(check, context)}
        alone = judging.judge_check(case, tolerances, check, {check.output: actual[check.output]},
                                    {check.output: golden[check.output]}, own, True)
        assert json.dumps(alone, sort_keys=True, default=str) == json.dumps(everything, sort_keys=True, default=str), check
        failed += not everything[0]["passed"]
    assert failed  # the wrong values were seen: the comparison above covered failing verdicts
