"""Bisect of the MoE layer (`layer=moe bisect=true`) on real ranks: each defect of
tests/defects/ is located at its stage and rank, with moe.md §13.5's masks.

The dispatch and combine are judged from every rank's own inputs by the spec's replay
(`layers.moe.layer.dispatch_reference`, `combine_reference`), never by the collectives under test.
"""

from __future__ import annotations

import pytest
import torch

from launcher.verify import build_comparator
from layers.contract.checks import ActiveRowsCheck, ExactCheck
from layers.contract.config import TINY
from layers.contract.case import MoECase
from layers.moe.layer import LAYER

from .. import defects

CASE = dict(layer="moe", ep=4, model="tiny", layer_id=5, num_tokens=64)


class MoeRoutesToTheWrongRankOnRank2(defects.MoeRoutesToTheWrongRank):
    """Only rank 2 sends its routes to the next rank: every rank receives wrong rows."""

    def defective(self, stage, ctx, v):
        return super().defective(stage, ctx, v) if ctx.rank == 2 else stage.run(ctx, v)


def _bisect(tp_run, impl) -> tuple[dict, dict[str, dict]]:
    run = tp_run(**CASE, impl=impl, bisect=True)
    assert run.exit_code == 1, run
    report = run.result["bisect"]
    assert report["diverged"] and f"bisect: first divergence at stage '{report['stage']}'" in run.report
    return report, {row["stage"]: row for row in report["stages"]}


@pytest.mark.parametrize("impl, stage, tensor, rank, ranks", [
    (defects.MoeRoutesToTheWrongRank, "dispatch", "send_meta", 0, [0, 1, 2, 3]),
    (MoeRoutesToTheWrongRankOnRank2, "dispatch", "send_meta", 2, [0, 1, 2, 3]),
    (defects.MoeCombineReusesDispatchSplits, "combine", "routed_y_buf", 0, None),
    (defects.MoeDropsTheRoutingWeight, "routed_experts", "recv_y", 0, [0, 1, 2, 3]),
    # rank 1 gates, routes and reduces its inactive tokens too: its gate rows past num_tokens are
    # masked (a device may leave them stale), so the first error is what it sends
    (defects.MoeProcessesTokensPastNumTokens, "dispatch", "send_meta", 1, [0, 1, 2, 3]),
])
def test_each_moe_defect_is_bisected_to_its_stage_and_rank(tp_run, impl, stage, tensor, rank, ranks):
    report, rows = _bisect(tp_run, impl)
    assert (report["stage"], report["tensor"], report["rank"], report["mode"]) == (stage, tensor, rank, "isolated")
    assert ranks is None or report["ranks"] == ranks
    names = list(rows)
    assert names[: names.index(stage)] == ["hc_pre", "gate", "shared_expert", "dispatch", "routed_experts",
                                           "combine", "reduce", "hc_post"][: names.index(stage)]
    assert all(rows[n]["passed"] for n in names[: names.index(stage)])  # nothing upstream is blamed
    if impl is MoeRoutesToTheWrongRankOnRank2:
        # the source alone sends wrongly; the others receive wrongly
        cells = {c["rank"]: {t["tensor"]: t["passed"] for t in c["tensors"]} for c in rows["dispatch"]["per_rank"]}
        assert [r for r, c in cells.items() if c["send_meta"] is False] == [2]
        assert all(c["recv_meta"] is False for c in cells.values())


# -- the masks of §13.5, fed wrong answers ------------------------------------------------------------
def _judge(check, actual: dict, expected: dict, num_tokens: int):
    cmp = build_comparator(check, mapping_shape=(), leading_rank_axis=False)
    return cmp.evaluate(actual[check.output], expected[check.output], inputs={"num_tokens": torch.tensor(num_tokens)},
                        actual_outputs=actual, expected_outputs=expected)


def _gate_pair(n_rows=8, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(32, generator=g)[:k] for _ in range(n_rows)]).to(torch.int32)
    weights = torch.rand(n_rows, k, generator=g)
    return {"indices": indices, "weights": weights}


def test_index_rows_are_sets_and_weights_move_with_them():
    idx = ActiveRowsCheck(ExactCheck("indices"), order_by="indices")
    w = ActiveRowsCheck(ExactCheck("weights"), order_by="indices")
    expected = _gate_pair()
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    actual = {n: t[:, perm].clone() for n, t in expected.items()}  # the same routes, another tie order
    assert _judge(idx, actual, expected, 8).passed and _judge(w, actual, expected, 8).passed
    unused = sorted(set(range(32)) - set(expected["indices"][2].tolist()))
    actual["indices"][2, 0] = unused[0]  # a wrong expert
    bad = _judge(idx, actual, expected, 8)
    assert not bad.passed and "on the 8 active rows" in bad.label
    actual = {n: t[:, perm].clone() for n, t in expected.items()}
    actual["weights"][2] = actual["weights"][2].flip(0)  # weights no longer with their experts
    assert not _judge(w, actual, expected, 8).passed


def test_only_active_rows_and_routes_are_judged():
    expected = _gate_pair()
    actual = {n: t.clone() for n, t in expected.items()}
    actual["indices"][5:] = 0  # rows of inactive tokens: anything goes
    check = ActiveRowsCheck(ExactCheck("indices"), order_by="indices")
    assert _judge(check, actual, expected, 5).passed
    assert not _judge(check, actual, expected, 6).passed
    k = 6
    buf = {"routed_y_buf": torch.randn(8 * k, 4)}
    stale = {"routed_y_buf": buf["routed_y_buf"].clone()}
    stale["routed_y_buf"][3 * k :] = 7.0  # the inactive tokens' routes, left stale
    routes = ActiveRowsCheck(ExactCheck("routed_y_buf"), rows_per_token=k)
    assert _judge(routes, stale, buf, 3).passed
    stale["routed_y_buf"][3 * k - 1, 0] += 1  # the last active route
    assert not _judge(routes, stale, buf, 3).passed


def test_the_stage_list_carries_the_masks():
    stages = {s.name: s for s in LAYER.stages(TINY)}
    gate = {o.name: o.check for o in stages["gate"].writes}
    assert all(isinstance(c, ActiveRowsCheck) for c in gate.values())
    assert gate["indices"].order_by == gate["weights"].order_by == "indices"
    (combine,) = stages["combine"].writes
    assert combine.check.rows_per_token == MoECase(TINY, 2, 0).model.num_experts_per_tok
    assert stages["dispatch"].reference is not None and stages["combine"].reference is not None
