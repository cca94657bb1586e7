"""CSA CP prefill at tiny dims in one process against the independent whole-prompt golden: the
canonical case and those the reference never runs (history, uneven segments whose compressor
windows straddle ranks, short segments, cp 1/4/8 with the top-k selecting), the golden's own
properties, the defects of the rank-local stages that must FAIL naming tensor and rank (the
compact-exchange defects run through the launcher, tests/e2e/test_prefill_csa.py), and the
early refusals."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from layers.contract.config import TINY, ConfigError
from layers.prefill import csa, csa_golden, csa_layer, csa_math, csa_tables, fixture
from layers.prefill.case import PrefillCase
from tests import defects
from tests.prefill.judge import WholePromptCases, failures

LAYER = csa_layer.LAYER
CASES = WholePromptCases(LAYER)
case, _inputs, _expected, _run = CASES.case, CASES.inputs, CASES.expected, CASES.run


def _with_defect(defect) -> tuple:
    """The stage list with the defect's (rank-local) stages replaced by its version."""
    impl = defect()
    return tuple(dataclasses.replace(s, run=functools.partial(impl.defective, s)) if s.name in impl.stages else s
                 for s in csa.stages())


@pytest.mark.parametrize("c", [
    case(1), case(2),
    case(2, prefix=301),  # windows, raw and compressed, reach into history; a block straddles it
    case(2, prefix=300, segment_lens=(201, 77, 256, 130)),  # compressor windows straddle ranks
    case(2, prefix=6, segment_lens=(3, 2, 5, 128)),  # windows reach several segments back, and history
    case(2, prefix=2, segment_lens=(1, 1, 1, 1)),  # one-row segments; the early queries select no row
], ids=lambda c: f"cp{c.cp}-p{c.prefix}-{'x'.join(map(str, c.lengths))}")
def test_case_passes(c):
    assert _run(c) == []


@pytest.mark.slow
@pytest.mark.parametrize("c", [
    case(4),
    case(4, prefix=1000, segment_lens=(1, 255, 64, 100, 128, 3, 250, 60)),  # one-row segments
    case(8, segment_lens=(100,) * 16),
], ids=lambda c: f"cp{c.cp}-p{c.prefix}-{'x'.join(map(str, c.lengths))}")
def test_larger_case_passes(c):
    assert _run(c) == []


def test_golden_depends_on_positions_only():
    """The same prompt cut into other segments (or over another cp) gives the same golden."""
    a, b = case(2, prefix=301, segment_lens=(201, 77, 256, 130)), case(4, prefix=301,
                                                                         segment_lens=(80,) * 7 + (104,))
    prompt = fixture.whole_prompt(a)
    ga, gb = csa_golden.golden(a, _inputs(a)[:1], prompt)[0], csa_golden.golden(b, _inputs(b)[:1], prompt)[0]
    for name in csa_layer.COMPARED:
        assert torch.equal(ga[name], gb[name]), name


def test_golden_commits_each_block_and_the_last_state_rows():
    """cmp_kv and the idx pools gain exactly the rows of the blocks completed in the step; both
    state pools the last 8 positions' rows, each at its own table's row; nothing else moves."""
    c = case(2, prefix=301, segment_lens=(201, 77, 256, 130))
    before = _inputs(c)[0]
    out = csa_golden.golden(c, [before], fixture.whole_prompt(c))[0]
    end = c.prefix + c.total

    def changed(name):
        return (out[name] != before[name]).reshape(-1, out[name].shape[-1]).any(-1).nonzero().flatten().tolist()

    slots = torch.arange(c.prefix // 4, end // 4)
    assert changed("cmp_kv") == csa_tables.cmp_rows(before["cmp_block_table"], slots).tolist()
    assert changed("idx_kv_scale") == csa_tables.cmp_rows(before["idx_block_table"], slots).tolist()
    for pool, table in (("compress_state", "compress_state_block_table"),
                        ("inner_compress_state", "inner_compress_state_block_table")):
        want = csa_tables.state_rows(before[table], torch.arange(end - 8, end))
        assert sorted(changed(pool)) == sorted(want.tolist()), pool


def test_compressed_row_pools_its_block_and_the_one_before():
    """A block inside one segment: the golden's main row equals pooling its 8 positions by hand
    (front halves of the 4 before, back halves of its own 4), normalized."""
    c, m = case(1), TINY
    w = _inputs(c)[0]
    normed = csa_golden.swa_golden.project(m, w, fixture.whole_prompt(c), torch.arange(c.total))["normed"]
    states = csa_math.states(normed, torch.arange(c.total), w, csa_math.MAIN)
    inner = csa_math.states(normed, torch.arange(c.total), w, csa_math.INNER)
    rows, _, _ = csa_math.compress(m, w, states, inner, 0, [11])
    hd = m.head_dim
    kv = torch.cat((states[4:8, :hd], states[8:12, hd:2 * hd]))
    score = torch.cat((states[4:8, 2 * hd:3 * hd], states[8:12, 3 * hd:]))
    pooled = (kv * score.softmax(dim=0)).sum(0)
    y = pooled * torch.rsqrt(pooled.square().mean() + m.rms_norm_eps) * w["cmp_norm_w"].float()
    nope = hd - m.qk_rope_head_dim
    torch.testing.assert_close(rows[0, :nope].float(), y[:nope].to(torch.bfloat16).float(), atol=0, rtol=1 / 128)


def test_top_k_selects():
    """Queries see more compressed rows than they keep: at tiny dims from position 67 on; at
    the real dims' canonical cases only from cp=8 (512 rows against the reference's 256)."""
    from layers.contract.config import FLASH
    assert csa_tables.selected_width(TINY.index_topk) == 16
    assert csa_tables.selected_width(FLASH.index_topk) == 256
    canonical = {cp: (2 * cp * 128) // 4 for cp in (2, 4, 8)}
    assert [cp for cp, seen in canonical.items() if seen > csa_tables.selected_width(FLASH.index_topk)] == [8]


def test_top_k_keeps_the_highest_scores_in_order():
    """cmp_indices: the top K slots by score among the visible ones, −1 past min(K, visible)."""
    m = TINY
    q = torch.ones(3, m.index_n_heads, m.index_head_dim, dtype=torch.int8)
    idx = torch.zeros(40, m.index_head_dim, dtype=torch.int8)
    idx[:, 0] = torch.arange(40, dtype=torch.int8)  # slot u scores u
    got = csa_math.select(m, q, torch.ones(3, m.index_n_heads, 1), torch.ones(3, m.index_n_heads), idx,
                          torch.ones(40), torch.tensor([40, 20, 3]))
    assert got[0].tolist() == list(range(39, 23, -1))
    assert got[1].tolist() == list(range(19, 3, -1))
    assert got[2].tolist() == [2, 1, 0] + [-1] * 13


@pytest.mark.parametrize("kw, words", [
    (dict(cp_layout="contiguous"), "cp_layout=zigzag"),
    (dict(scope="collectives"), "scope=full"),
    (dict(prefix=4000), "scores at most 1024"),
])
def test_bad_case_refused_early(kw, words):
    with pytest.raises(ConfigError, match=words):
        LAYER.validate(dataclasses.replace(case(2), **kw))


def test_window_shorter_than_a_compressor_window_refused():
    with pytest.raises(ConfigError, match="sliding_window >= 8"):
        LAYER.validate(PrefillCase("csa", TINY.replace(sliding_window=4), 2, 7, segment_lens=(4,) * 4))


def test_stacked_golden_is_every_rank_golden():
    """The golden from tensors in the reference's snapshot layout equals each rank's own."""
    assert CASES.stacked_golden_mismatches(case(2, prefix=301, segment_lens=(201, 77, 256, 130))) == []


def test_beyond_reference_names_a_window_reaching_two_segments_back():
    assert case(2).beyond_reference() == []
    notes = case(2, prefix=6, segment_lens=(3, 2, 5, 128)).beyond_reference()
    assert any("compressor window reaching past" in n for n in notes)
    assert not any("compressor window" in n for n in case(2, segment_lens=(100,) * 4).beyond_reference())


@pytest.mark.parametrize("defect, c, bad", [
    (defects.PrefillCSALocalRopePositions, case(2), {(1, "x_out"), (0, "kv_cache"), (1, "kv_cache")}),
    # every segment's first block pools the 4 positions before it: the overlap always straddles
    (defects.PrefillCSAWindowFromOwnRowsOnly, case(2),
     {(r, n) for r in (0, 1) for n in ("cmp_kv", "idx_kv_cache", "idx_kv_scale", "x_out")}),
    (defects.PrefillCSAInnerStateFromWrongSegment, case(2), {(0, "inner_compress_state"), (1, "inner_compress_state")}),
    (defects.PrefillCSATopkAtLocalPositions, case(2), {(0, "x_out"), (1, "x_out")}),
    # segment 2's first block pools positions 4 … 11: history, segment 0's, segment 1's
    (defects.PrefillCSAWindowFromPredecessorOnly, case(2, prefix=6, segment_lens=(3, 2, 5, 128)),
     {(r, n) for r in (0, 1) for n in ("cmp_kv", "idx_kv_scale")}),
], ids=lambda x: getattr(x, "__name__", None))
def test_defect_fails_naming_tensor_and_rank(defect, c, bad):
    assert bad <= set(_run(c, _with_defect(defect)))



def test_predecessor_only_windows_pass_when_every_segment_is_longer_than_a_window():
    """Segments of 130 after 301 history rows: every window reaches at most one segment back."""
    c = case(2, prefix=301, segment_lens=(130,) * 4)
    assert _run(c, _with_defect(defects.PrefillCSAWindowFromPredecessorOnly)) == []


def test_default_profile_catches_one_wrong_indexer_row_the_reference_profile_lets_through():
    """One committed int8 row off by 2: the default profile (no element budget) FAILs it, the
    reference's (1 % of the pool) lets it through; off by 2 in 2 % of the pool FAILs both."""
    c = case(1, segment_lens=(8, 8))
    want = _expected(c, _inputs(c))
    one, many = [dict(w) for w in want], [dict(w) for w in want]
    for got, rows in ((one, 1), (many, 41)):  # 41 of the 2048 rows: 2 %
        idx = got[0]["idx_kv_cache"].clone()
        idx.view(-1, idx.shape[-1])[:rows] += 2
        got[0]["idx_kv_cache"] = idx
    assert failures(csa.default_checks(), one, want) == [(0, "idx_kv_cache")]
    assert failures(csa.reference_checks(), one, want) == []
    assert failures(csa.reference_checks(), many, want) == [(0, "idx_kv_cache")]
