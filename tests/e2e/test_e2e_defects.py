"""CSA and HCA end to end: one defect each must FAIL, naming the tensor that proves it and the rank.

x_out barely reacts to compressor errors (spec hca.md); the cache and state comparisons are
what catch them.
"""

from __future__ import annotations

import pytest

from .. import defects


@pytest.mark.parametrize(
    "layer, impl, tensor",
    [
        ("csa", defects.CsaMissedCommit, "cmp_kv"),
        ("csa", defects.CsaStateWrongSlot, "compress_state"),
        ("csa", defects.CsaSentinelOverwritten, "compress_state"),
        ("csa", defects.CsaTopkOffByOne, "x_out"),
        ("csa", defects.PerturbRankTokens, "x_out"),
        ("hca", defects.HcaMissedCommit, "cmp_kv"),
        ("hca", defects.HcaPoolsWrongRows, "cmp_kv"),
        ("hca", defects.HcaWrongRopePosition, "cmp_kv"),
        ("hca", defects.PerturbRankTokens, "x_out"),
        ("csa", defects.ReduceScatterWithoutSum, "x_out"),
        ("hca", defects.GroupsToWrongRank, "x_out"),
    ],
)
def test_defect_fails_naming_tensor_and_rank(tp_run, layer, impl, tensor):
    run = tp_run(layer=layer, tp=2, model="tiny", impl=impl)
    assert run.exit_code == 1, run
    v = run.verdict(tensor)
    assert not v["passed"], run
    bad_ranks = [r["rank"] for r in v["per_rank"] if r["n_bad"] or r.get("stray_rows") or r.get("nan_actual")]
    assert bad_ranks, run
    if impl is defects.PerturbRankTokens:
        assert bad_ranks == [1]
    assert f"{tensor} FAIL" in run.report
