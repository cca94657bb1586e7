"""CP prefill end to end through the launcher: cases PASS, each CP-protocol defect FAILs naming
the tensor and the rank, and bad keys are refused before any rank starts."""

from __future__ import annotations

import pytest

from .. import defects


@pytest.mark.parametrize("keys", [
    dict(cp=2), dict(cp=4, cp_layout="contiguous"), dict(cp=1),
    dict(cp=2, prefix=300, segment_lens="[128,40,30,200]"),
], ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_prefill_passes(tp_run, keys):
    run = tp_run(layer="swa", phase="prefill", model="tiny", **keys)
    assert run.exit_code == 0, run
    assert run.result["case"]["cp"] == keys["cp"]


@pytest.mark.parametrize("impl, keys, tensor, ranks", [
    (defects.PrefillMissingPredecessorTail, {}, "x_out", [1]),
    (defects.PrefillLocalRopePositions, {}, "x_out", [0, 1]),
    (defects.PrefillFinalWindowOnOwnerOnly, {}, "kv_cache", [1]),  # zigzag: rank 0 owns the last segment
    (defects.PrefillDroppedKeys, {"segment_lens": "[128,40,30,128]"}, "x_out", [0, 1]),  # segments 2 and 3 reach back past their predecessor
], ids=lambda x: getattr(x, "__name__", None))
def test_prefill_defect_fails_naming_tensor_and_rank(tp_run, impl, keys, tensor, ranks):
    run = tp_run(layer="swa", phase="prefill", cp=2, model="tiny", impl=impl, **keys)
    assert run.exit_code == 1, run
    v = run.verdict(tensor)
    assert not v["passed"], run
    assert [r["rank"] for r in v["per_rank"] if r["n_bad"]] == ranks, run


def test_dropped_keys_pass_when_every_segment_fills_the_window(tp_run):
    run = tp_run(layer="swa", phase="prefill", cp=2, model="tiny", impl=defects.PrefillDroppedKeys)
    assert run.exit_code == 0, run


@pytest.mark.parametrize("keys, words", [
    (dict(phase="prefill", tp=2), "tp=2 is a key of phase=decode"),
    (dict(phase="prefill", layer="csa"), "no prefill stage list"),
    (dict(cp=2), "cp=2 is a key of phase=prefill"),
    (dict(phase="prefill", segment_lens="[128,128]"), "2\\*cp = 4 segments"),
    (dict(phase="warmup"), "phase='warmup'"),
])
def test_bad_prefill_keys_refused(tp_run, keys, words):
    import re

    run = tp_run(model="tiny", **{"layer": "swa", **keys})
    assert run.exit_code != 0 and re.search(words, run.output), run
