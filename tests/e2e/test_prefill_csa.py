"""CSA CP prefill end to end through the launcher: cases PASS (history, uneven segments whose
compressor windows straddle ranks, cp 1 and 4), each defect FAILs naming the tensor and the
rank, bisect names the stage and ranks, and what CSA prefill does not run is refused early."""

from __future__ import annotations

import re

import pytest

from .. import defects
from .prefill_runs import assert_fails_and_located, assert_saved_run_replays

COMPARED = ("kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale", "compress_state", "inner_compress_state", "x_out")


@pytest.mark.parametrize("keys", [
    dict(cp=2), dict(cp=1),
    dict(cp=4, prefix=301, segment_lens="[201,77,256,130,1,60,128,3]"),
], ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_csa_prefill_passes(tp_run, keys):
    run = tp_run(layer="csa", phase="prefill", model="tiny", **keys)
    assert run.exit_code == 0, run
    for tensor in COMPARED:
        assert run.verdict(tensor)["passed"], run


@pytest.mark.parametrize("impl, failing, located", [
    (defects.PrefillCSALocalRopePositions, {"x_out": [0, 1]}, ("project", [0, 1])),
    (defects.PrefillCSAWindowFromOwnRowsOnly, {"cmp_kv": [0, 1], "idx_kv_cache": [0, 1]}, ("compressor", [0, 1])),
    # rank 0 owns the last segment: its inner state rows go to every rank
    (defects.PrefillCSAInnerStateFromWrongSegment, {"inner_compress_state": [0, 1], "compress_state": []},
     ("compressor", [0])),
    (defects.PrefillCSATopkAtLocalPositions, {"x_out": [0, 1]}, ("indexer_topk", [0, 1])),
    (defects.PrefillCSAIndexerRowsOnOwnerOnly, {"idx_kv_cache": [0, 1], "idx_kv_scale": [0, 1], "cmp_kv": []},
     ("compact_exchange", [0, 1])),
], ids=lambda x: getattr(x, "__name__", None))
def test_csa_prefill_defect_fails_naming_tensor_and_rank_and_bisect_locates_it(tp_run, impl, failing, located):
    """Each defect FAILs the named tensors on the named ranks (others may fail too) and bisect
    names the first divergent stage and its ranks."""
    run = tp_run(layer="csa", phase="prefill", cp=2, model="tiny", impl=impl, bisect=True)
    assert_fails_and_located(run, COMPARED, failing, located)


@pytest.mark.parametrize("keys, words", [
    (dict(cp_layout="contiguous"), "cp_layout=zigzag"),
    (dict(scope="collectives", cp_layout="contiguous"), "cp_layout=zigzag"),
    (dict(prefix=4000), "scores at most 1024"),
])
def test_csa_prefill_refusals(tp_run, keys, words):
    run = tp_run(layer="csa", phase="prefill", model="tiny", **keys)
    assert run.exit_code != 0 and re.search(words, run.output), run


EXCHANGED = ("logical_tails_out", "logical_hidden_tails", *COMPARED[1:6])


def test_csa_collectives_scope_passes(tp_run):
    run = tp_run(layer="csa", phase="prefill", cp=4, scope="collectives", model="tiny")
    assert run.exit_code == 0, run
    assert all(run.verdict(t)["passed"] for t in EXCHANGED), run


@pytest.mark.parametrize("impl, failing", [
    (defects.PrefillTailsInRankMajorOrder, {"logical_tails_out": [0, 1], "logical_hidden_tails": [0, 1]}),
    (defects.PrefillCSAIndexerRowsOnOwnerOnly, {"idx_kv_cache": [0, 1], "idx_kv_scale": [0, 1]}),
], ids=lambda x: getattr(x, "__name__", None))
def test_csa_collectives_scope_defect_fails_naming_tensor_and_rank(tp_run, impl, failing):
    run = tp_run(layer="csa", phase="prefill", cp=2, scope="collectives", model="tiny", impl=impl)
    assert run.exit_code == 1, run
    bad = {t: [r["rank"] for r in run.verdict(t)["per_rank"] if r["n_bad"]] for t in EXCHANGED}
    assert {t: ranks for t, ranks in bad.items() if ranks} == failing, run


def test_saved_csa_snapshot_replays(tp_run, tmp_path):
    """The reference's tensor names in the saved folder; a replay with golden_data alone reads the
    case back and PASSes, with our manifest or without it (its indexer pool names the layer)."""
    assert_saved_run_replays(tp_run, tmp_path / "saved", "csa", 301, [201, 77, 256, 130],
                             {"idx_kv_cache", "inner_compress_state_block_table", "idx_weights_proj", "query_positions"})
