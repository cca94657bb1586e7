"""HCA CP prefill end to end through the launcher: cases PASS (both layouts, history, uneven
segments whose compressor windows straddle ranks, cp 1 and 4), each defect FAILs naming the tensor and the
rank, bisect names the stage and ranks, and what HCA prefill does not run is refused early."""

from __future__ import annotations

import re

import pytest

from .. import defects
from .prefill_runs import assert_fails_and_located, assert_saved_run_replays


@pytest.mark.parametrize("keys", [
    dict(cp=2), dict(cp=1),
    dict(cp=4, prefix=300, segment_lens="[200,77,256,130,1,60,128,3]"),
    dict(cp=2, cp_layout="contiguous"),
    dict(cp=4, cp_layout="contiguous", prefix=300, segment_lens="[200,77,256,130,1,60,128,3]"),
], ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_hca_prefill_passes(tp_run, keys):
    run = tp_run(layer="hca", phase="prefill", model="tiny", **keys)
    assert run.exit_code == 0, run
    for tensor in ("x_out", "kv_cache", "cmp_kv", "compress_state"):
        assert run.verdict(tensor)["passed"], run


COMPARED = ("kv_cache", "cmp_kv", "compress_state", "x_out")


@pytest.mark.parametrize("impl, keys, failing, located", [
    (defects.PrefillHCALocalRopePositions, {}, {"x_out": [0, 1]}, ("project", [0, 1])),
    (defects.PrefillHCAWindowFromOwnRowsOnly, {"segment_lens": "[100,100,100,100]"},
     {"cmp_kv": [0, 1], "compress_state": [0, 1]}, ("compressor", [0, 1])),
    (defects.PrefillHCAWindowFromPredecessorOnly, {"prefix": 100, "segment_lens": "[128,40,30,128]"},
     {"cmp_kv": [0, 1]}, ("compressor", [0])),  # rank 0's segment 3 has a block reaching into segment 1
    # rank 0 owns the last segment: rank 1 keeps its state rows from before the step
    (defects.PrefillHCAStateOnOwnerOnly, {}, {"compress_state": [1]}, ("compact_exchange", [1])),
    (defects.PrefillHCACompressedRowsOnOwnerOnly, {}, {"cmp_kv": [0, 1]}, ("compact_exchange", [0, 1])),
    # contiguous: rank 1 keys and pools from rank 0's rows where its own belong, and the reverse
    (defects.PrefillHCAAllGatherRingOrder, {"cp_layout": "contiguous"},
     {"x_out": [1], "kv_cache": [1], "cmp_kv": [1], "compress_state": [1]}, ("kv_allgather", [1])),
    # rank 1 owns the final segment; each rank lacks the other's blocks
    (defects.PrefillHCAGatheredOwnBlocksOnly, {"cp_layout": "contiguous"},
     {"cmp_kv": [0, 1], "compress_state": [0]}, ("gathered_compressor", [0, 1])),
], ids=lambda x: getattr(x, "__name__", None))
def test_hca_prefill_defect_fails_naming_tensor_and_rank_and_bisect_locates_it(tp_run, impl, keys, failing, located):
    """Each defect FAILs the named tensors on the named ranks (others may fail too) and bisect
    names the first divergent stage and its ranks."""
    run = tp_run(layer="hca", phase="prefill", cp=2, model="tiny", impl=impl, bisect=True, **keys)
    assert_fails_and_located(run, COMPARED, failing, located)


@pytest.mark.parametrize("keys, words", [
    (dict(prefix=5000), "ring of 32"),
    (dict(prefix=5000, scope="collectives"), "ring of 32"),
])
def test_hca_prefill_refusals(tp_run, keys, words):
    run = tp_run(layer="hca", phase="prefill", model="tiny", **keys)
    assert run.exit_code != 0 and re.search(words, run.output), run


@pytest.mark.parametrize("layout, outputs", [
    ("zigzag", ("logical_tails_out", "logical_hidden_tails", "cmp_kv", "compress_state")),
    ("contiguous", ("gathered_kv", "gathered_state")),
])
def test_hca_collectives_scope_passes(tp_run, layout, outputs):
    run = tp_run(layer="hca", phase="prefill", cp=4, cp_layout=layout, scope="collectives", model="tiny")
    assert run.exit_code == 0, run
    assert all(run.verdict(t)["passed"] for t in outputs), run


@pytest.mark.parametrize("impl, layout, failing", [
    (defects.PrefillTailsInRankMajorOrder, "zigzag", {"logical_tails_out": [0, 1], "logical_hidden_tails": [0, 1]}),
    (defects.PrefillHCAStateOnOwnerOnly, "zigzag", {"compress_state": [1]}),
    (defects.PrefillHCACompressedRowsOnOwnerOnly, "zigzag", {"cmp_kv": [0, 1]}),
    (defects.PrefillHCAAllGatherRingOrder, "contiguous", {"gathered_kv": [1], "gathered_state": [1]}),
], ids=lambda x: getattr(x, "__name__", None))
def test_hca_collectives_scope_defect_fails_naming_tensor_and_rank(tp_run, impl, layout, failing):
    run = tp_run(layer="hca", phase="prefill", cp=2, cp_layout=layout, scope="collectives", model="tiny", impl=impl)
    assert run.exit_code == 1, run
    outputs = {"zigzag": ("logical_tails_out", "logical_hidden_tails", "cmp_kv", "compress_state"),
               "contiguous": ("gathered_kv", "gathered_state")}[layout]
    bad = {t: [r["rank"] for r in run.verdict(t)["per_rank"] if r["n_bad"]] for t in outputs}
    assert {t: ranks for t, ranks in bad.items() if ranks} == failing, run


def test_saved_hca_snapshot_replays(tp_run, tmp_path):
    """The reference's tensor names in the saved folder; a replay with golden_data alone reads the
    case back and PASSes."""
    assert_saved_run_replays(tp_run, tmp_path / "saved", "hca", 300, [200, 77, 256, 130],
                             {"compress_state_block_table", "cmp_block_table", "query_positions"})
