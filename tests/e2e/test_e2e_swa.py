"""The SWA layer end to end: the real launcher, real processes, real gloo collectives."""

from __future__ import annotations

import math

import pytest

from layers.contract.case import Case
from layers.contract.config import PRESETS
from layers.registry import get_layer

from .. import defects


def _failed(run, tensor):
    return run.verdict(tensor)["passed"] is False


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tiny_passes_at_every_tp(tp_run, tp):
    run = tp_run(layer="swa", tp=tp, model="tiny")
    assert run.passed, run
    # The per-rank front of the layer is the golden's own code: the cache is bit-identical.
    assert run.verdict("kv_cache")["figures"]["max_abs_diff"] == 0
    assert len(run.verdict("x_out")["per_rank"]) == tp


def test_tiny_below_capacity(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", local_t=56)
    assert run.passed, run
    assert run.result["case"]["local_t"] == 56


def test_flash_tp2(tp_run):
    run = tp_run(layer="swa", tp=2, model="flash", local_t=64)
    assert run.passed, run
    assert run.result["integrity"]["passed"] and len(run.result["integrity"]["checks"]) == 7
    # Each rank's peak RSS is reported, and holds at least the rank's fixture slice.
    case = Case("swa", PRESETS["flash"], 2, 64, 0)
    slice_mib = sum(math.prod(s.shape) * s.dtype.itemsize for s in get_layer("swa").tensor_specs(case).values()) / 2**20
    rss = run.result["rank_peak_rss_mib"]
    assert len(rss) == 2 and all(slice_mib < r < 8 * 1024 for r in rss), (rss, slice_mib)


@pytest.mark.parametrize(
    "impl, tensor, bad_ranks",
    [
        (defects.ReduceScatterWithoutSum, "x_out", {0, 1}),
        (defects.GroupsToWrongRank, "x_out", {0, 1}),
        (defects.PerturbRankTokens, "x_out", {1}),
        (defects.CacheWriteWrongSlot, "kv_cache", {0, 1}),
    ],
)
def test_defect_fails_naming_tensor_and_rank(tp_run, impl, tensor, bad_ranks):
    run = tp_run(layer="swa", tp=2, model="tiny", impl=impl)
    assert run.exit_code == 1, run
    assert _failed(run, tensor)
    ranks = {r["rank"] for r in run.verdict(tensor)["per_rank"] if r["n_bad"] or r.get("stray_rows")}
    assert ranks == bad_ranks, run
    assert f"{tensor} FAIL" in run.report
