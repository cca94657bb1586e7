"""`layer=moe scope=collectives` on real ranks: the count exchange, the int8 dispatch and the
bf16 combine alone on integer data, compared bitwise in sentinel-filled windows; a defect in
either all-to-all FAILs there, the project's own passes."""

from __future__ import annotations

import pytest

from layers.contract.case import MoECase
from layers.contract.config import TINY
from layers.moe.collectives import SENTINEL, MoECollectivesScope, source_inputs

from .. import defects


@pytest.mark.parametrize("ep, num_tokens", [(1, None), (2, 100), (4, 0), (8, 37)])
def test_the_project_collectives_pass_bitwise(tp_run, ep, num_tokens):
    run = tp_run(layer="moe", ep=ep, model="tiny", scope="collectives", num_tokens=num_tokens)
    assert run.passed, run
    assert [v["tensor"] for v in run.result["verdicts"]] == ["recv_meta", "recv_x", "recv_aux", "recv_route",
                                                             "routed_y_buf"]
    assert all(v["figures"]["max_abs_diff"] == 0 for v in run.result["verdicts"])


@pytest.mark.parametrize("impl, failing", [
    (defects.MoeCombineReusesDispatchSplits, {"routed_y_buf"}),  # the dispatch is right, its way back is not
    (defects.MoeRoutesToTheWrongRank, {"recv_meta", "recv_x", "recv_aux", "recv_route", "routed_y_buf"}),
    (defects.MoeProcessesTokensPastNumTokens, {"recv_meta", "recv_x", "recv_aux", "recv_route", "routed_y_buf"}),
])
def test_an_all_to_all_defect_fails_under_the_scope(tp_run, impl, failing):
    run = tp_run(layer="moe", ep=2, model="tiny", scope="collectives", num_tokens=100, impl=impl)
    assert run.exit_code == 1, run
    assert {v["tensor"] for v in run.result["verdicts"] if not v["passed"]} == failing
    if impl is defects.MoeProcessesTokensPastNumTokens:
        assert "poison (-100,) in the output" in run.report  # rank 1's inactive tokens arrived


def test_the_routes_are_uneven_and_leave_an_empty_lane():
    # what makes swapped splits visible: ranks send each other different numbers of rows
    case = MoECase(TINY, 2, 20260819, scope="collectives")
    routes = [source_inputs(case, r)["indices"].long() for r in range(2)]
    to_other = [int((routes[r] // case.local_experts == 1 - r).sum()) for r in range(2)]
    assert to_other[0] != to_other[1]
    assert all(int(r.max()) < case.routed_experts - 1 for r in routes)  # expert E-1 receives nothing


def test_the_golden_refuses_inputs_that_are_not_its_recipe():
    case = MoECase(TINY, 2, 20260819, scope="collectives")
    scope = MoECollectivesScope()
    tensors = scope.rank_inputs(case, 1)
    assert (tensors["recv_x"] == SENTINEL).all()
    tensors["weights"][0, 0] += 1
    with pytest.raises(ValueError, match="closed-form inputs"):
        scope.golden(case, tensors)


@pytest.mark.parametrize("overrides, message", [
    (["scope=collectives", "layer_id=5"], "layer_id=5 does not apply to layer=moe scope=collectives"),
    (["scope=collectives", "balanced_routing=true"], "balanced_routing=True does not apply to layer=moe scope=collectives"),
    (["scope=output"], "layer=moe runs scope=full or collectives"),
])
def test_routing_keys_and_other_scopes_are_refused(tp_run, overrides, message):
    run = tp_run(layer="moe", model="tiny", overrides=overrides)
    assert run.exit_code == 2 and message in run.report, run
