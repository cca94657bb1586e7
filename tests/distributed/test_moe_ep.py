"""The MoE layer's EP forward on real gloo ranks against its per-rank golden (moe.md §3, §8, §13).

Every rank builds its own fixture slice, computes its share of the golden (every source's
gate, its own experts' routed rows), the harness gathers those rows to rank 0, which
assembles the golden x_next; then every rank runs the EP forward with real collectives and
rank 0 compares the gathered x_next with the §8 comparator (ratio_reldiff(3e-3, 0.05), one
pooled budget, per-rank figures). The forward batches every expert's rows in the golden's
order, so a correct run is bitwise equal; the comparator must still PASS it and FAIL, naming
the rank, each deliberate defect.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from launcher.verify import build_comparator
from layers.moe import layer as moe
from layers.contract.staged import run_stages
from layers.contract.case import MoECase
from layers.contract.config import TINY
from layers.contract.context import RankContext
from layers.distributed import ep, wire
from layers.distributed.golden_walk import golden_stage
from layers.moe import fixture
from layers.tp import TorchTP

from .. import defects
from ..rank_harness import run_ranks

SEED = 20260819
# A global expert no token chooses in the `unused_expert` cases: rank 1's local expert 5.
UNUSED = 16 + 5


# -- deliberate defects: the stage overrides of tests/defects/, on the ranks named ------------------
DEFECTS = {
    "wrong_rank": defects.MoeRoutesToTheWrongRank,
    "unswapped_combine": defects.MoeCombineReusesDispatchSplits,
    "no_routing_weight": defects.MoeDropsTheRoutingWeight,
}


# -- one rank's job -----------------------------------------------------------------------------
def _tensors(case: MoECase, rank: int, unused_expert: bool) -> dict[str, torch.Tensor]:
    tensors = fixture.rank_inputs(case, rank)
    if unused_expert:
        # Identical on every rank (replicated): the hash table never names UNUSED, and its bias
        # keeps it out of every score layer's top-k (the weights use unbiased scores).
        u = torch.rand(tensors["tid2eid"].shape[0], case.routed_experts, generator=torch.Generator().manual_seed(1))
        u[:, UNUSED] = 2.0
        tensors["tid2eid"] = torch.topk(u, 6, dim=1, largest=False).indices.to(torch.int32)
        tensors["gate_bias"][UNUSED] = -1e4
    return tensors


def _job(rank: int, world: int, kw: dict, defect: str | None, defect_ranks: tuple[int, ...], past_num_tokens: tuple[int, ...]):
    torch.manual_seed(0)  # nothing may depend on the global generator; a fixed one shows it
    unused_expert = kw.pop("unused_expert", False)
    case = MoECase(TINY, world, SEED, **kw)
    case.validate()
    ctx = RankContext(case, rank, torch.device("cpu"), dist.group.WORLD if world > 1 else None)
    tensors = _tensors(case, rank, unused_expert)
    # the golden first, from clones: the forward may not change what the golden read
    walked = run_stages(moe.LAYER.stages(ctx.model), ctx, {n: x.clone() for n, x in tensors.items()}, golden_stage)
    golden = wire.gather(walked["x_next"], rank, world, ctx.group)
    inputs = {n: x.clone() for n, x in tensors.items()}
    if rank in past_num_tokens:
        inputs["num_tokens"] = torch.tensor(case.tokens, dtype=torch.int32)  # processes tokens t >= n
    impl = DEFECTS[defect]() if defect and rank in defect_ranks else TorchTP()
    values = run_stages(moe.LAYER.stages(ctx.model), ctx, inputs, run_stage=impl.run_stage)
    actual = wire.gather(values["x_next"], rank, world, ctx.group)
    # the dispatch stage alone: pure data movement, so bitwise the golden's replay
    dispatch_exact = all(torch.equal(values[n], walked[n]) for n in ("recv_meta", "recv_x", "recv_aux", "recv_route"))
    return {"golden": golden, "actual": actual, "recv_count": values["recv_meta"].sum(0),
            "sent": int(values["send_meta"].sum()), "dispatch_exact": dispatch_exact}  # fmt: skip


def _run(world, defect=None, defect_ranks=(), past_num_tokens=(), **kw):
    per_rank = run_ranks(world, _job, kw, defect, tuple(defect_ranks), tuple(past_num_tokens))
    case = MoECase(TINY, world, SEED, **{k: v for k, v in kw.items() if k != "unused_expert"})
    verdict = build_comparator(moe.checks(case)[0], mapping_shape=(), leading_rank_axis=True).evaluate(
        per_rank[0]["actual"], per_rank[0]["golden"])
    return per_rank, verdict


def _bad_ranks(verdict) -> list[int]:
    return [r.rank for r in verdict.per_rank if r.n_bad]


# -- the forward matches the golden ------------------------------------------------------------------
@pytest.mark.parametrize(
    "world,kw",
    [
        (1, {}),
        (2, {}),
        (2, dict(layer_id=4, num_tokens=100)),
        (2, dict(num_tokens=0)),
        (4, dict(layer_id=3, num_tokens=37)),
        (4, dict(balanced_routing=True, num_tokens=64)),
        (4, dict(layer_id=9, num_tokens=0)),
        (4, dict(unused_expert=True)),
        (4, dict(unused_expert=True, layer_id=5, num_tokens=120)),
        (8, {}),
        (8, dict(balanced_routing=True)),
        (8, dict(layer_id=7, num_tokens=1)),
        (16, dict(layer_id=5, num_tokens=100)),
    ],
    ids=lambda x: str(x) if not isinstance(x, dict) else ",".join(f"{k}={v}" for k, v in x.items()) or "hash-full",
)
def test_ep_forward_matches_the_golden(world, kw):
    per_rank, verdict = _run(world, **kw)
    golden, actual = per_rank[0]["golden"], per_rank[0]["actual"]
    assert golden.shape == (world, 128, 4, TINY.hidden_size) and torch.isfinite(golden).all()
    assert verdict.passed, verdict.detail
    assert torch.equal(actual, golden), f"max |diff| {(actual - golden).abs().max():.3g}"
    assert all(r["dispatch_exact"] for r in per_rank)
    n = kw.get("num_tokens", 128)
    assert sum(r["sent"] for r in per_rank) == sum(int(r["recv_count"].sum()) for r in per_rank) == world * n * 6
    if kw.get("balanced_routing"):
        assert all((r["recv_count"] == 3 * n // 8).all() for r in per_rank)  # §6: every expert 3n/8 rows
    if kw.get("unused_expert"):
        counts = torch.cat([r["recv_count"] for r in per_rank])
        assert counts[UNUSED] == 0 and (counts[torch.arange(len(counts)) != UNUSED] > 0).all()
    if n == 0:
        # nothing routed: x_next is every token's residual mix (ffn_out = sh = 0), not zero
        assert golden.abs().sum() > 0


# -- defects FAIL, naming the ranks --------------------------------------------------------------------
def test_a_route_to_the_wrong_rank_fails_on_its_source():
    _per_rank, verdict = _run(4, defect="wrong_rank", defect_ranks=(1,), layer_id=4)
    assert not verdict.passed and verdict.kind == "budget"
    assert _bad_ranks(verdict) == [1]
    assert "rank 1: bad=" in verdict.detail
    assert [r["dispatch_exact"] for r in _per_rank] == [False] * 4  # rank 1's rows reached every wrong rank


def test_combine_with_the_dispatch_splits_fails():
    # (layer 4's routes are uneven between the two ranks: 391 from rank 0 to 1, 378 back)
    _per_rank, verdict = _run(2, defect="unswapped_combine", defect_ranks=(0, 1), layer_id=4)
    assert not verdict.passed and verdict.kind == "budget"
    assert _bad_ranks(verdict) and all(f"rank {r}: bad=" in verdict.detail for r in _bad_ranks(verdict))
    # balanced routing sends and receives the same rows per pair: the same defect is harmless there
    _per_rank, balanced = _run(2, defect="unswapped_combine", defect_ranks=(0, 1), balanced_routing=True)
    assert balanced.passed and balanced.figures["n_bad"] == 0


def test_a_dropped_routing_weight_fails_on_every_source_of_the_expert():
    per_rank, verdict = _run(4, defect="no_routing_weight", defect_ranks=(2,), num_tokens=96)
    assert not verdict.passed
    assert _bad_ranks(verdict) == [0, 1, 2, 3]  # every rank routes some tokens to rank 2's experts
    assert "rank 2: bad=" in verdict.detail


def test_tokens_past_num_tokens_fail_on_their_rank():
    _per_rank, verdict = _run(2, past_num_tokens=(1,), num_tokens=64, layer_id=5)
    assert not verdict.passed and _bad_ranks(verdict) == [1]
    worst = verdict.per_rank[1].max_abs_diff_at
    assert worst[0] == 1 and worst[1] >= 64  # rank 1, an inactive token


@pytest.mark.one_process
def test_ep_sizes_without_a_group_are_refused():
    case = MoECase(TINY, 2, SEED)
    ctx = RankContext(case, 0, torch.device("cpu"), None)
    with pytest.raises(RuntimeError, match="ep=2 needs a process group"):
        ep.count_exchange(ctx, torch.zeros(2, 16, dtype=torch.int32))


# -- the comparator of §8 --------------------------------------------------------------------------------
def _x_next_pair(p=2, seed=3):
    e = torch.randn(p, 128, 4, TINY.hidden_size, generator=torch.Generator().manual_seed(seed))
    return e.clone(), e


def _moe_comparator(p=2):
    return build_comparator(moe.checks(MoECase(TINY, p, 0))[0], mapping_shape=(), leading_rank_axis=True)


@pytest.mark.one_process
def test_comparator_budget_is_pooled_over_ranks_and_counts_inactive_tokens():
    a, e = _x_next_pair()
    numel = e.numel()
    budget = round(0.05 * numel)  # 13107 of 262144
    flat = a[1].view(-1)  # rank 1 alone: 10 % of its elements, 5 % of the whole
    flat[:budget] += 1.0  # |diff| >= 3e-3 and relative to max(|a|, |e|, 0.0203) above 3e-3: bad
    v = _moe_comparator().evaluate(a, e)
    assert v.passed and v.figures["n_bad"] == budget and [r.n_bad for r in v.per_rank] == [0, budget]
    flat[budget] += 1.0  # one more point anywhere fails (the last rows are inactive tokens)
    v = _moe_comparator().evaluate(a, e)
    assert not v.passed and v.kind == "budget" and v.figures["margin"] == 1
    assert "rank 1: bad=13108/131072" in v.detail


@pytest.mark.one_process
def test_comparator_rule_is_floored_relative_with_no_single_point_cap():
    a, e = _x_next_pair()
    e[0, 0, 0, :3] = torch.tensor([0.0, 2.0, 1.0])
    a[0, 0, 0, :3] = torch.tensor([0.0031, 2.005, 1000.0])
    v = _moe_comparator().evaluate(a, e)
    # 0.0031 at 0: bad (floor 0.0203); 0.005 at 2: within 3e-3 relative; 999 at 1: bad but no cap
    assert v.passed and v.figures["n_bad"] == 2 and v.figures["max_diff_hd"] == float("inf")
