"""Several TP groups in one launch (dp x tp): every group is judged on its own data, and code that
mixes up the global rank and the group rank, or the world group and the TP group, fails."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from layers.contract.case import Case
from layers.contract.config import TINY
from layers.registry import get_layer
from layers.tp import TorchTP

from .. import defects
from .test_multinode import _two_nodes


class ChecksItsContext(TorchTP):
    """The default implementation, after checking what the context says about the rank."""

    def __call__(self, ctx, tensors):
        assert ctx.global_rank == dist.get_rank(), (ctx.global_rank, dist.get_rank())
        assert ctx.rank == dist.get_rank(ctx.group) and ctx.tp == dist.get_world_size(ctx.group)
        assert ctx.group_index == ctx.global_rank // ctx.tp
        return super().__call__(ctx, tensors)


@pytest.mark.parametrize("layer", ["swa", "csa", "hca"])
@pytest.mark.parametrize("tp", [2, 4])
def test_every_group_passes_on_its_own_data(tp_run, layer, tp):
    run = tp_run(layer=layer, tp=tp, dp=2, model="tiny", impl=ChecksItsContext)
    assert run.passed, run
    groups = run.result["groups"]
    assert [g["ranks"] for g in groups] == [list(range(tp)), list(range(tp, 2 * tp))]
    assert groups[0]["seed"] == run.result["case"]["seed"] != groups[1]["seed"]
    assert all(g["passed"] for g in groups) and len(run.result["rank_seconds"]) == 2 * tp


def test_groups_draw_different_fixtures():
    case = Case("swa", TINY, 2, 64, 7)
    assert case.of_group(0) is case
    other = case.of_group(1)
    assert (other.layer, other.tp, other.local_t) == (case.layer, case.tp, case.local_t) and other.seed != case.seed
    layer = get_layer("swa")
    assert not torch.equal(layer.rank_inputs(case, 0)["x_hc"], layer.rank_inputs(other, 0)["x_hc"])


@pytest.mark.parametrize("impl, failing", [
    # rank 0 of group 1 projects the wrong heads; the reduce-scatter spreads it to the whole group
    (defects.GroupSliceByGlobalRank, {1: [0, 1]}),
    (defects.ReduceOnTheWorldGroup, {0: [0, 1], 1: [0, 1]}),
    (defects.PerturbGroup1Rank1, {1: [1]}),
])
def test_group_mix_ups_fail_naming_group_and_rank(tp_run, impl, failing):
    run = tp_run(layer="swa", tp=2, dp=2, model="tiny", impl=impl)
    assert run.exit_code == 1, run
    for g in run.result["groups"]:
        bad = sorted({pr["rank"] for v in g["verdicts"] for pr in v["per_rank"] if pr.get("n_bad")})
        assert bad == failing.get(g["group"], []), (g["group"], bad)
        assert g["passed"] == (g["group"] not in failing)
    first = min(failing)
    assert run.result["verdicts"] == run.result["groups"][first]["verdicts"]  # the top level names it
    (line,) = [ln for ln in run.report.splitlines() if ln.startswith("VERDICT: ")]
    assert line.startswith("VERDICT: FAIL by reference (group "), line  # each failing group named with its tensor
    assert all((f"group {g} " in line) == (g in failing) for g in (0, 1)), line
    rank = failing[first][0]
    assert f"{rank} (global {first * 2 + rank})" in run.report


def test_save_data_writes_one_snapshot_per_group_each_replayable_alone(tp_run, tmp_path):
    out = tmp_path / "snap"
    assert tp_run(layer="swa", tp=2, dp=2, model="tiny", save_data=str(out)).passed
    seeds = []
    for g in (0, 1):
        manifest = json.loads((out / f"group{g}" / "manifest.json").read_text())
        seeds.append(manifest["seed"])
        replay = tp_run(layer="swa", tp=2, model="tiny", golden_data=str(out / f"group{g}"))
        assert replay.passed, replay
    assert seeds[0] != seeds[1]


@pytest.mark.parametrize("overrides, message", [
    (["dp=0"], "dp=0 must be >= 1"),
    (["dp=-2"], "dp=-2 must be >= 1"),
    (["dp=2", "nproc_per_node=2"], "must equal dp*tp=2*2=4"),
    (["dp=2", "golden_data=/tmp/nowhere"], "it needs dp=1, not dp=2"),
    (["dp=2", "fault.kind=raise", "fault.rank=4"], "fault.rank=4 must be in [0, 4)"),
])
def test_bad_dp_is_refused_before_any_rank_starts(tp_run, overrides, message):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=overrides)
    assert run.exit_code == 2 and message in run.report, run
    assert run.result["status"] == "config-error"


@pytest.mark.timeout(300)
def test_four_groups_across_two_loopback_nodes(tmp_path):
    res = _two_nodes(tmp_path, ["layer=swa", "tp=2", "dp=4", "model=tiny"])
    assert res[0][0] == 0 and "VERDICT: PASS" in res[0][1], res[0][1]
    assert "group 3 (global ranks 6-7" in res[0][1]
    assert res[1][0] == 0 and "its verdict: PASS" in res[1][1], res[1][1]
