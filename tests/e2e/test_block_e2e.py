"""layer=block through the launcher: the decoder layer on real gloo ranks, every attention kind
passing with TP groups inside the MoE's world, and each hand-off defect failing with x_next
and its ranks named."""

from __future__ import annotations

import pytest

from .. import defects


@pytest.mark.parametrize("attention", ["swa", "csa", "hca"])
def test_each_attention_kind_passes_in_two_tp_groups(tp_run, attention):
    run = tp_run(layer="block", attention=attention, tp=2, ep=4, model="tiny")
    assert run.passed, run
    case = run.result["case"]
    assert (case["attention"], case["tp"], case["ep"], case["local_t"]) == (attention, 2, 4, 64)
    v = run.verdict("x_next")
    assert v["passed"] and len(v["per_rank"]) == 4
    assert f"block {attention} tiny tp=2 ep=4 local_t=64" in run.output  # the progress label


def test_layer_id_picks_the_attention_and_the_moe_routing(tp_run):
    run = tp_run(layer="block", layer_id=11, tp=1, ep=2, model="tiny")
    assert run.passed, run
    assert (run.result["case"]["attention"], run.result["case"]["layer_id"]) == ("hca", 11)
    assert run.verdict("x_next")["figures"]["max_abs_diff"] == 0  # data-parallel attention: bit for bit


@pytest.mark.parametrize("impl", [
    defects.BlockRowsReordered,
    defects.BlockRowsOfAnotherGroup,
    defects.BlockResidualBeforeAttention,
    defects.BlockDispatchesPaddedRows,
])
def test_hand_off_defects_fail_naming_x_next_and_the_ranks(tp_run, impl):
    run = tp_run(layer="block", attention="csa", tp=2, ep=4, model="tiny", impl=impl)
    assert run.exit_code == 1, run
    v = run.verdict("x_next")
    assert [pr["rank"] for pr in v["per_rank"] if pr.get("n_bad")] == [0, 1, 2, 3], v
    assert "x_next FAIL" in run.report
    assert all(run.verdict(n)["passed"] for n in ("kv_cache", "cmp_kv"))  # the attention half is right


@pytest.mark.parametrize("overrides, message", [
    (["attention=swa", "layer_id=2"], "layer_id=2 is a csa layer"),
    (["attention=csa", "tp=4", "ep=2"], "tp >= 1 dividing it"),
    (["attention=csa", "num_tokens=8"], "num_tokens=8 does not apply to layer=block"),
    (["attention=csa", "scope=tp1"], "layer=block runs scope=full"),
    (["attention=csa", "save_data=/tmp/never"], "layer=block has no snapshot layout yet"),
])
def test_bad_block_keys_are_refused(tp_run, overrides, message):
    run = tp_run(layer="block", model="tiny", overrides=overrides)
    assert run.exit_code == 2 and message in run.report, run


@pytest.mark.parametrize("impl, stage", [
    (defects.BlockRowsReordered, "hand_off"),
    (defects.BlockRowsOfAnotherGroup, "hand_off"),
    (defects.BlockResidualBeforeAttention, "moe.hc_post"),
    (defects.BlockDispatchesPaddedRows, "moe.dispatch"),
])
def test_bisect_names_the_half_and_stage_of_each_hand_off_defect(tp_run, impl, stage):
    run = tp_run(layer="block", attention="swa", tp=2, ep=4, model="tiny", impl=impl, bisect=True)
    assert run.exit_code == 1, run
    report = run.result["bisect"]
    assert (report["stage"], report["ranks"]) == (stage, [0, 1, 2, 3]), report
    stages = [row["stage"] for row in report["stages"]]
    assert stages[0] == "swa.hc_pre" and "swa.reduce_scatter" in stages and stages[-2] == "moe.hc_post"
    assert all(row["passed"] for row in report["stages"][: stages.index(stage)])
