"""The CSA layer end to end: the real launcher, real processes, real gloo collectives."""

from __future__ import annotations

import pytest

POOLS = ("compress_state", "inner_compress_state", "kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale")


# tp=1: the one-rank forward is bitwise the golden in tests/conformance, and the launcher's
# one-rank path is test_e2e_swa's.
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tiny_passes_at_every_tp(tp_run, tp):
    run = tp_run(layer="csa", tp=tp, model="tiny")
    assert run.passed, run
    # Everything before the output half is the golden's own per-rank code: the pools are
    # bit-identical, only x_out carries the reduce-scatter's fp32 summation order.
    for name in POOLS:
        assert run.verdict(name)["figures"]["max_abs_diff"] == 0, name
    assert len(run.verdict("x_out")["per_rank"]) == tp


def test_tiny_below_capacity(tp_run):
    """local_t = LOCAL_T − 8 changes the global batch (and every table), not just a slice (§9.15)."""
    run = tp_run(layer="csa", tp=2, model="tiny", local_t=56)
    assert run.passed, run
    assert run.result["case"]["local_t"] == 56
