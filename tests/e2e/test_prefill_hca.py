"""HCA CP prefill end to end through the launcher: cases PASS (history, uneven segments whose
compressor windows straddle ranks, cp 1 and 4), each defect FAILs naming the tensor and the
rank, bisect names the stage and ranks, and what HCA prefill does not run is refused early."""

from __future__ import annotations

import re

import pytest

from .. import defects
from .prefill_runs import assert_fails_and_located, assert_saved_run_replays


@pytest.mark.parametrize("keys", [
    dict(cp=2), dict(cp=1),
    dict(cp=4, prefix=300, segment_lens="[200,77,256,130,1,60,128,3]"),
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
], ids=lambda x: getattr(x, "__name__", None))
def test_hca_prefill_defect_fails_naming_tensor_and_rank_and_bisect_locates_it(tp_run, impl, keys, failing, located):
    """Each defect FAILs the named tensors on the named ranks (others may fail too) and bisect
    names the first divergent stage and its ranks."""
    run = tp_run(layer="hca", phase="prefill", cp=2, model="tiny", impl=impl, bisect=True, **keys)
    assert_fails_and_located(run, COMPARED, failing, located)


@pytest.mark.parametrize("keys, words", [
    (dict(cp_layout="contiguous"), "cp_layout=zigzag"),
    (dict(scope="collectives"), "scope=full"),
    (dict(prefix=5000), "ring of 32"),
])
def test_hca_prefill_refusals(tp_run, keys, words):
    run = tp_run(layer="hca", phase="prefill", model="tiny", **keys)
    assert run.exit_code != 0 and re.search(words, run.output), run


def test_saved_hca_snapshot_replays(tp_run, tmp_path):
    """The reference's tensor names in the saved folder; a replay with golden_data alone reads the
    case back and PASSes."""
    assert_saved_run_replays(tp_run, tmp_path / "saved", "hca", 300, [200, 77, 256, 130],
                             {"compress_state_block_table", "cmp_block_table", "query_positions"})
