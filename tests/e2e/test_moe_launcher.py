"""The MoE layer through the launcher: `python -m launcher layer=moe ep=P` on real ranks, the
reference's own snapshot replayed, and its pitfalls' defects failing with rank named."""

from __future__ import annotations

import pytest

from .. import defects, moe_snapshot
from ..conftest import reference_snapshot


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_tiny_moe_passes_at_every_ep(tp_run, ep):
    run = tp_run(layer="moe", ep=ep, model="tiny")
    assert run.passed, run
    assert run.result["case"]["ep"] == ep and "tp" not in run.result["case"]
    v = run.verdict("x_next")
    assert v["passed"] and len(v["per_rank"]) == ep


@pytest.mark.parametrize("keys", [
    dict(layer_id=5, num_tokens=37),  # score routing, a partial batch
    dict(num_tokens=0),  # nothing routed: empty splits everywhere
    dict(balanced_routing=True, num_tokens=64),
])
def test_moe_cases(tp_run, keys):
    run = tp_run(layer="moe", ep=4, model="tiny", **keys)
    assert run.passed, run
    for k, v in keys.items():
        assert run.result["case"][k] == v


def test_ep16_at_tiny_dims(tp_run):
    run = tp_run(layer="moe", ep=16, model="tiny", num_tokens=16)
    assert run.passed, run


def test_the_reference_snapshot_replays_on_two_real_ranks(tp_run):
    src = reference_snapshot("moe")
    run = tp_run(layer="moe", ep=2, model="tiny", golden_data=str(src), recompute_golden=True)
    assert run.passed, run
    assert run.result["recomputed_verdicts"][0]["figures"]["max_abs_diff"] == 0  # bit for bit, our golden
    # Against the snapshot: bit for bit where this CPU's GEMMs round as the snapshot's machine's
    # did, else exactly our golden's gap to it, which the expert outputs' rounding explains.
    gap = moe_snapshot.reference_gap(src)
    assert gap.acceptable(), gap
    assert run.result["verdicts"][0]["figures"]["max_abs_diff"] == gap.max_abs_diff


@pytest.mark.parametrize("impl, ranks", [
    (defects.MoeRoutesToTheWrongRank, [0, 1, 2, 3]),
    (defects.MoeCombineReusesDispatchSplits, None),
    (defects.MoeDropsTheRoutingWeight, [0, 1, 2, 3]),
    (defects.MoeProcessesTokensPastNumTokens, [1]),
])
def test_moe_defects_fail_naming_the_tensor_and_rank(tp_run, impl, ranks):
    run = tp_run(layer="moe", ep=4, model="tiny", layer_id=5, num_tokens=64, impl=impl)
    assert run.exit_code == 1, run
    v = run.verdict("x_next")
    bad = [pr["rank"] for pr in v["per_rank"] if pr.get("n_bad")]
    assert bad and (ranks is None or bad == ranks), bad
    assert "x_next FAIL" in run.report


@pytest.mark.parametrize("overrides, message", [
    (["tp=2"], "tp=2 does not apply to layer=moe"),
    (["local_t=64"], "local_t=64 does not apply to layer=moe"),
    (["ep=0"], "ep=0 must be in [1, 16]"),
    (["ep=17"], "ep=17 must be in [1, 16]"),
    (["num_tokens=129"], "num_tokens=129 must be in [0, 128]"),
    (["scope=tp1"], "layer=moe runs scope=full or collectives"),
])
def test_bad_moe_keys_are_refused(tp_run, overrides, message):
    run = tp_run(layer="moe", model="tiny", overrides=overrides)
    assert run.exit_code == 2 and message in run.report, run


def test_moe_keys_on_an_attention_layer_are_refused(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=["num_tokens=64"])
    assert run.exit_code == 2 and "num_tokens=64 does not apply to layer=swa: num_tokens is a key of layer=moe" in run.report, run
