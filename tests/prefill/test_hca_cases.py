"""HCA CP prefill at tiny dims in one process against the independent whole-prompt golden: the
canonical case and those the reference never runs (both layouts, history, uneven segments whose compressor
windows straddle ranks, short segments, cp 1/4/8), the golden's own properties, the defects
of the rank-local stages that must FAIL naming tensor and rank (the compact-exchange defects
run through the launcher, tests/e2e/test_prefill_hca.py), and the early refusals."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from layers.components.hca_compressor import COMPRESS_RATIO
from layers.contract.config import TINY, ConfigError
from layers.prefill import fixture, golden as swa_golden, hca, hca_golden, hca_layer, hca_tables, registry
from layers.prefill.case import PrefillCase
from tests import defects
from tests.prefill.judge import WholePromptCases

LAYER = hca_layer.LAYER
CASES = WholePromptCases(LAYER)
case, _inputs, _expected, _run = CASES.case, CASES.inputs, CASES.expected, CASES.run


def _with_defect(defect, c: PrefillCase | None = None) -> tuple:
    """The stage list of case `c`'s layout (zigzag's without one) with the defect's
    (rank-local) stages replaced by its version."""
    impl = defect()
    listed = registry.of_case(c).stages(c.model) if c is not None else hca.stages()
    return tuple(dataclasses.replace(s, run=functools.partial(impl.defective, s)) if s.name in impl.stages else s
                 for s in listed)


@pytest.mark.parametrize("c", [
    case(1), case(2), case(4),
    case(2, prefix=300),  # windows, raw and compressed, reach into history
    case(2, prefix=300, segment_lens=(200, 77, 256, 130)),  # compressor windows straddle ranks
    case(2, prefix=100, segment_lens=(128, 40, 30, 128)),  # a window reaches two segments back
    case(4, prefix=1000, segment_lens=(1, 255, 64, 100, 128, 3, 250, 60)),  # one-row segments, the top-k cap
    # the contiguous layout: every rank pools every block from the gathered states
    case(1, cp_layout="contiguous"), case(2, cp_layout="contiguous"),
    case(2, cp_layout="contiguous", prefix=100, segment_lens=(128, 40, 30, 128)),
    case(4, cp_layout="contiguous", prefix=300, segment_lens=(200, 77, 256, 130, 1, 60, 128, 3)),
], ids=lambda c: f"{c.cp_layout}-cp{c.cp}-p{c.prefix}-{'x'.join(map(str, c.lengths))}")
def test_case_passes(c):
    assert _run(c) == []


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp8_passes(layout):
    assert _run(case(8, cp_layout=layout, segment_lens=(100,) * 16)) == []


def test_golden_depends_on_positions_only():
    """The same prompt cut into other segments (or over another cp) gives the same golden."""
    a, b = case(2, prefix=300, segment_lens=(200, 77, 256, 130)), case(4, prefix=300,
                                                                         segment_lens=(80,) * 7 + (103,))
    prompt = fixture.whole_prompt(a)
    ga, gb = hca_golden.golden(a, _inputs(a)[:1], prompt)[0], hca_golden.golden(b, _inputs(b)[:1], prompt)[0]
    for name in ("x_out", "kv_cache", "cmp_kv", "compress_state"):
        assert torch.equal(ga[name], gb[name]), name


def test_golden_commits_each_block_and_the_last_state_rows():
    """cmp_kv gains exactly the rows of the blocks completed in the step; compress_state the
    last 128 positions' rows, each at its table row; nothing else moves."""
    c = case(2, prefix=300, segment_lens=(200, 77, 256, 130))
    inputs = _inputs(c)
    out = hca_golden.golden(c, inputs, fixture.whole_prompt(c))[0]
    hd, end = c.model.head_dim, c.prefix + c.total
    changed = (out["cmp_kv"] != inputs[0]["cmp_kv"]).reshape(-1, hd).any(-1).nonzero().flatten()
    slots = torch.arange(c.prefix // COMPRESS_RATIO, end // COMPRESS_RATIO)
    assert changed.tolist() == hca_tables.cmp_rows(inputs[0]["cmp_block_table"], slots).tolist()
    rows = (out["compress_state"] != inputs[0]["compress_state"]).reshape(-1, 2 * hd).any(-1).nonzero().flatten()
    want = hca_tables.state_rows(inputs[0]["compress_state_block_table"], torch.arange(end - COMPRESS_RATIO, end),
                                 c.model.c128_state_block_size)
    assert sorted(rows.tolist()) == sorted(want.tolist())


def test_compressed_row_is_the_pool_of_its_block():
    """A block inside one segment: the golden's row equals pooling its 128 rows by hand."""
    c = case(1)
    w = _inputs(c)[0]
    prompt = fixture.whole_prompt(c)
    front = swa_golden.project(c.model, w, prompt, torch.arange(c.total))
    states = hca_golden.compressor_states(c, w, front["normed"], torch.zeros(0, 2 * c.model.head_dim))
    rows, slots = hca_golden.compress(c, w, states, 0)
    kv, score = states[128:256].split(c.model.head_dim, dim=-1)
    pooled = (kv * score.softmax(dim=0)).sum(0)
    y = pooled * torch.rsqrt(pooled.square().mean() + c.model.rms_norm_eps) * w["cmp_norm_w"].float()
    assert slots.tolist() == [0, 1]
    assert torch.equal(rows[1, :-c.model.qk_rope_head_dim], y[:-c.model.qk_rope_head_dim].to(torch.bfloat16))


@pytest.mark.parametrize("defect, c, bad", [
    (defects.PrefillHCALocalRopePositions, case(2), {(1, "x_out"), (0, "kv_cache"), (1, "kv_cache")}),
    (defects.PrefillHCAWindowFromOwnRowsOnly, case(2, segment_lens=(100,) * 4),
     {(0, "cmp_kv"), (1, "cmp_kv"), (0, "compress_state"), (1, "compress_state")}),
    (defects.PrefillHCAWindowFromPredecessorOnly, case(2, prefix=100, segment_lens=(128, 40, 30, 128)),
     {(0, "cmp_kv"), (1, "cmp_kv")}),
], ids=lambda x: getattr(x, "__name__", None))
def test_defect_fails_naming_tensor_and_rank(defect, c, bad):
    assert bad <= set(_run(c, _with_defect(defect)))


@pytest.mark.parametrize("c, bad", [
    # rank 0 lacks rank 1's blocks 2, 3 and the final state rows; rank 1 lacks blocks 0, 1
    (case(2, cp_layout="contiguous"), {(0, "cmp_kv"), (1, "cmp_kv"), (0, "compress_state")}),
    (case(4, cp_layout="contiguous", prefix=300, segment_lens=(200, 77, 256, 130, 1, 60, 128, 3)),
     {(r, "cmp_kv") for r in range(4)} | {(r, "compress_state") for r in range(3)}),
], ids=["canonical", "uneven"])
def test_contiguous_compressor_of_own_blocks_only_fails(c, bad):
    """Under the contiguous layout no compact exchange follows the compressor: a rank that makes
    only its own blocks' rows (zigzag's share) leaves the others' out of its pools."""
    assert set(_run(c, _with_defect(defects.PrefillHCAGatheredOwnBlocksOnly, c))) == bad


@pytest.mark.parametrize("defect", [defects.PrefillHCAWindowFromOwnRowsOnly,
                                    defects.PrefillHCAWindowFromPredecessorOnly])
def test_window_defects_pass_when_blocks_align_with_segments(defect):
    """Segments of 128 from position 0: no window straddles, so neither defect shows."""
    assert _run(case(2), _with_defect(defect)) == []


@pytest.mark.parametrize("kw, words", [
    (dict(prefix=4000), "ring of 32"),
])
def test_bad_case_refused_early(kw, words):
    with pytest.raises(ConfigError, match=words):
        LAYER.validate(dataclasses.replace(case(2), **kw))


def test_window_other_than_the_ratio_refused():
    with pytest.raises(ConfigError, match="sliding_window = 128"):
        LAYER.validate(PrefillCase("hca", TINY.replace(sliding_window=64), 2, 7, segment_lens=(64,) * 4))


def test_stacked_golden_is_every_rank_golden():
    """The golden from tensors in the reference's snapshot layout equals each rank's own."""
    assert CASES.stacked_golden_mismatches(case(2, prefix=300, segment_lens=(200, 77, 256, 130))) == []


def test_window_reaching_two_segments_back_is_said_beyond_the_reference():
    assert case(2).beyond_reference() == []
    notes = " ".join(case(2, prefix=100, segment_lens=(128, 40, 30, 128)).beyond_reference())
    assert "compressor window reaching past" in notes
    assert "compressor window" not in " ".join(case(2, segment_lens=(100,) * 4).beyond_reference())
