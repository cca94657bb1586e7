"""The MoE layer's golden cache and snapshots on real ranks: a second identical run reads its
golden from the cache with the same verdict, a tampered entry is a miss, and a run saved as a
snapshot replays against its own golden (and still catches a defect)."""

from __future__ import annotations

import torch

from layers.contract.config import TINY

from .. import defects

MOE = dict(layer="moe", ep=2, model="tiny", layer_id=4, num_tokens=96)


def _figures(run) -> tuple:
    v = run.verdict("x_next")
    return v["passed"], v["figures"]["n_bad"], v["figures"]["max_abs_diff"]


def test_a_second_identical_run_hits_the_cache_with_the_same_verdict(tp_run, tmp_path):
    for i, impl in enumerate(("layers.tp.TorchTP", defects.MoeDropsTheRoutingWeight)):
        cache = str(tmp_path / f"cache{i}")
        first = tp_run(**MOE, golden_cache=cache, impl=impl)
        second = tp_run(**MOE, golden_cache=cache, impl=impl)
        assert first.result["golden_cache_hits"] == [] and second.result["golden_cache_hits"] == [0, 1], second
        assert first.exit_code == second.exit_code and _figures(first) == _figures(second)
        assert "from the golden cache on ranks [0, 1]" in second.report
    assert first.exit_code == 1  # the defect FAILs with a cached golden too


def test_a_tampered_entry_is_a_miss_for_the_whole_group(tp_run, tmp_path):
    cache = tmp_path / "cache"
    assert tp_run(**MOE, golden_cache=str(cache)).passed
    (entry,) = [p for p in cache.glob("*.pt") if "-r1-" in p.name and "-inputs-" not in p.name]
    tampered = torch.load(entry, weights_only=True)
    tampered["tensors"]["x_next"][:8] += 1.0  # trusted, it would FAIL the correct implementation
    torch.save(tampered, entry)
    run = tp_run(**MOE, golden_cache=str(cache))
    assert run.passed, run
    assert run.result["golden_cache_hits"] == []  # rank 1 missed, so the group computed it together
    again = tp_run(**MOE, golden_cache=str(cache))
    assert again.passed and again.result["golden_cache_hits"] == [0, 1]  # the entry was rewritten


def test_a_saved_moe_run_replays_against_its_snapshot(tp_run, tmp_path):
    snap = tmp_path / "snap"
    saved = tp_run(**MOE, save_data=str(snap), golden_cache=None)
    assert saved.passed, saved
    assert sorted(p.name for p in (snap / "out").iterdir()) == ["x_next.pt"]
    x_hc = torch.load(snap / "in" / "x_hc.pt", weights_only=True)
    assert x_hc.shape == (2, 128, 4, TINY.hidden_size)  # rank-stacked, the reference layout
    assert int(torch.load(snap / "in" / "num_tokens.pt", weights_only=True)) == 96
    replay = tp_run(layer="moe", ep=2, model="tiny", golden_data=str(snap), recompute_golden=True)
    assert replay.passed, replay
    for verdicts in (replay.result["verdicts"], replay.result["recomputed_verdicts"]):
        assert verdicts[0]["figures"]["max_abs_diff"] == 0
    broken = tp_run(layer="moe", ep=2, model="tiny", golden_data=str(snap), impl=defects.MoeRoutesToTheWrongRank)
    assert broken.exit_code == 1, broken
    assert broken.result["reference"] == "snapshot" and not broken.verdict("x_next")["passed"]
