"""The HCA layer: metadata (hca.md §5), attention visibility (§4.6), long contexts, fixture, checks.

Metadata and attention are compared with loop re-statements of the spec written here (one
request / token / key at a time); the forward with the golden at the long contexts only HCA
reaches. The properties every layer shares are in tests/conformance.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from layers.hca import layer as hca
from layers.components import attention, metadata, rope
from layers.contract.case import Case
from layers.contract.checks import HIDDEN_AXES, PoolCheck, RelDiffCheck
from layers.contract.config import TINY, ConfigError
from layers.contract.context import RankContext
from layers.hca import fixture as hca_fixture
from layers.registry import validated


# The attention's exps as the layer evaluates them: correctly rounded fp32 (test_attention.py).
from layers.components.attention import exp_rounded_from_fp64 as _exp

RATIO = 128
WIDE = TINY.replace(name="tiny-wide", decode_batch=64)  # room for batch 31 (hca.md §10.1)
CPU = torch.device("cpu")
LONG = 1_048_576


# -- naive re-statements of §5 ------------------------------------------------------------------
def naive_raw_table(starts, model):
    seq, win, bs = model.decode_seq, model.sliding_window, model.block_size
    table, cursor = {}, 0
    for b, start in enumerate(starts):
        first, last = max(0, start - win + 1), start + seq - 1
        for j in range(last // bs - first // bs + 1):
            table[b, first // bs + j] = cursor + j
        cursor += last // bs - first // bs + 1
    return table


def naive_window(starts, model):
    """(ori_slot_mapping, window_swa_indices, window_swa_lens) token by token (§5.2)."""
    seq, win, bs = model.decode_seq, model.sliding_window, model.block_size
    table = naive_raw_table(starts, model)
    row = lambda b, q: table[b, q // bs] * bs + q % bs if (b, q // bs) in table else -1  # noqa: E731
    slots, indices, lens = [], [], []
    for b, start in enumerate(starts):
        for s in range(seq):
            p = start + s
            slots.append(row(b, p))
            window = [row(b, q) for q in range(max(0, p - win + 1), p + 1)]
            indices.append(window + [-1] * (win - len(window)))
            lens.append(len(window))
    return slots, indices, lens


def naive_cmp(starts, model, width):
    seq, bs = model.decode_seq, model.block_size
    table = [[-1] * width for _ in starts]
    cursor = 0
    for b, start in enumerate(starts):
        pages = math.ceil(min((start + seq) // RATIO, LONG // RATIO) / bs)
        for j in range(pages):
            table[b][j] = cursor + j
        cursor += pages
    slots = []
    for b, start in enumerate(starts):
        for p in range(start, start + seq):
            c = p // RATIO
            slots.append(table[b][c // bs] * bs + c % bs if (p + 1) % RATIO == 0 and table[b][c // bs] >= 0 else -1)
    return table, slots


def naive_state(starts, model):
    """The touched entries of the state table and the state slot mapping (§5.4), greedy in Python."""
    seq, sb, phys = model.decode_seq, model.c128_state_block_size, model.hca_state_physical_blocks
    batch = len(starts)
    default = lambda b, c: ((c % phys) * batch + b) % phys  # noqa: E731
    entries = {(b, p // sb): default(b, p // sb) for b, st in enumerate(starts) for p in range(st, st + seq)}
    rows = [entries[b, p // sb] * sb + p % sb for b, st in enumerate(starts) for p in range(st, st + seq)]
    if len(set(rows)) != len(rows):
        occupancy = [0] * phys
        for b, st in enumerate(starts):
            masks = {}
            for p in range(st, st + seq):
                masks[p // sb] = masks.get(p // sb, 0) | (1 << (p % sb))
            for page, mask in masks.items():
                pick = next((i for i, o in enumerate(occupancy) if o and not o & mask), None)
                if pick is None:
                    pick = occupancy.index(0)
                entries[b, page] = pick
                occupancy[pick] |= mask
        rows = [entries[b, p // sb] * sb + p % sb for b, st in enumerate(starts) for p in range(st, st + seq)]
    return entries, default, rows


CASES = [
    pytest.param(Case("hca", TINY, 2, 64, 0), id="canonical-batch8"),
    pytest.param(Case("hca", WIDE, 2, 248, 0), id="canonical-batch31"),
    pytest.param(Case("hca", TINY, 1, 32, 0, (16376, 16376, 131064, 524280)), id="mixed-long"),
    pytest.param(Case("hca", TINY, 1, 8, 0, (LONG - 8,)), id="1M-ceiling"),
]


@pytest.mark.parametrize("case", CASES)
def test_metadata_matches_the_spec_loops(case):
    m = case.model
    validated(case)
    starts = hca_fixture.rank_starts(case, 0)
    meta = hca_fixture.rank_metadata(case, starts)
    slots, indices, lens = naive_window(starts, m)
    assert meta["ori_slot_mapping"].tolist() == slots
    assert meta["window_swa_indices"].tolist() == indices
    assert meta["window_swa_lens"].tolist() == lens
    table, cmp_slots = naive_cmp(starts, m, hca_fixture.cmp_table_width(case))
    assert meta["cmp_block_table"].tolist() == table
    assert meta["cmp_slot_mapping"].tolist() == cmp_slots
    entries, default, rows = naive_state(starts, m)
    state = meta["compress_state_block_table"]
    assert state.shape == (case.batch, LONG // m.c128_state_block_size) and state.dtype == torch.int32
    assert meta["state_slot_mapping"].tolist() == rows
    assert len(set(rows)) == len(rows)
    for (b, page), phys in entries.items():
        assert state[b, page] == phys
    for c in [*range(0, 600), *range(state.shape[1] - 300, state.shape[1])]:  # untouched columns
        for b in range(case.batch):
            if (b, c) not in entries:
                assert state[b, c] == default(b, c), (b, c)
    pos = [st + s for st in starts for s in range(m.decode_seq)]
    assert meta["position_ids"].tolist() == pos
    assert meta["kv_seq_lens"].tolist() == [st + m.decode_seq for st in starts]
    # cmp RoPE rows: the block start's angle (§10.10), capacity rows past the batch are zero.
    half = m.qk_rope_head_dim // 2
    block_start = torch.tensor([st - st % RATIO for st in starts])
    cos, _ = rope.rope_rows(m, block_start, RATIO)
    assert torch.equal(meta["cmp_freqs_cos"][: len(starts)], cos[:, :half].float())
    assert not meta["cmp_freqs_cos"][len(starts) :].any()


def test_batch_31_default_table_aliases_and_is_re_placed():
    starts = hca_fixture.canonical_starts(Case("hca", WIDE, 2, 248, 0))
    pos = metadata.position_ids_from_starts(starts, 8)
    assert hca_fixture.injective_state_pages(pos, WIDE) is not None
    assert hca_fixture.injective_state_pages(pos[:8], WIDE) is None  # batch 8 divides the pool


# -- visibility of committed rows (§4.6 step 2, §10.4) ------------------------------------------
@pytest.mark.parametrize(
    "pos, seq_len, rows",
    [(126, 127, 0), (127, 128, 1), (128, 136, 1), (254, 256, 1), (255, 256, 2), (255, 200, 1), (LONG - 1, LONG, 8192)],
)
def test_visible_compressed_rows(pos, seq_len, rows):
    n_c = hca.visible_compressed_rows(torch.tensor([pos] * 8), torch.tensor([seq_len]), TINY)
    assert n_c.tolist() == [rows] * 8


def naive_attention(q, kv_cache, cmp_kv, window, cmp_table, positions, seq_lens, sink, model):
    """golden_sparse_attn (§4.6 steps 1-5), one token and one 128-key tile at a time."""
    t_all, h, hd = q.shape
    ori, ck = kv_cache.float().view(-1, hd), cmp_kv.float().view(-1, hd)
    out = torch.zeros(t_all, h, hd)
    for t in range(t_all):
        b = t // model.decode_seq
        rows = [ori[i] if i >= 0 else torch.zeros(hd) for i in window[t].tolist()]
        tiles = [(torch.stack(rows), window[t] >= 0)]
        n_c = min((int(positions[t]) + 1) // RATIO, int(seq_lens[b]) // RATIO, LONG // RATIO)
        for begin in range(0, n_c, 128):
            keys, valid = [], []
            for lane in range(128):
                c = begin + lane
                pg = int(cmp_table[b, c // 32]) if c // 32 < cmp_table.shape[1] else -1
                ok = lane < min(128, n_c - begin) and 0 <= pg < cmp_kv.shape[0]
                keys.append(ck[pg * 32 + c % 32] if ok else torch.zeros(hd))
                valid.append(ok)
            tiles.append((torch.stack(keys), torch.tensor(valid)))
        m_, l_, o_ = None, None, None
        for keys, valid in tiles:
            sc = (q[t].float() @ keys.T) * model.softmax_scale
            sc = sc.masked_fill(~valid[None], attention.NEG_INF)
            mi = sc.max(dim=-1, keepdim=True).values
            e = _exp(sc - mi).masked_fill(~valid[None], 0.0)
            li, oi = e.sum(dim=-1, keepdim=True), e.bfloat16().float() @ keys.bfloat16().float()
            if m_ is None:
                m_, l_, o_ = mi, li, oi
                continue
            mn = torch.maximum(m_, mi)
            a, be = _exp(m_ - mn), _exp(mi - mn)
            m_, l_, o_ = mn, a * l_ + be * li, a * o_ + be * oi
        out[t] = o_ / (l_ + _exp(sink[:, None] - m_))
    return out


@pytest.mark.parametrize("starts", [(120, 127, 255, 8192), (16376, 131064, 2, 133)])
def test_attention_over_window_and_committed_rows_matches_the_spec_loop(starts):
    m = TINY
    case = Case("hca", m, 1, 8 * len(starts), 0, starts)
    meta = hca_fixture.rank_metadata(case, list(starts))
    g = torch.Generator().manual_seed(3)
    t = case.local_t
    q = torch.randn(t, m.num_attention_heads, m.head_dim, generator=g).bfloat16()
    kv_cache = torch.randn(m.kv_ori_block_num, 32, 1, m.head_dim, generator=g).bfloat16()
    cmp_kv = torch.randn(m.kv_cmp_block_num, 32, 1, m.head_dim, generator=g).bfloat16()
    sink = torch.randn(m.num_attention_heads, generator=g)
    args = (meta["window_swa_indices"], meta["cmp_block_table"], meta["position_ids"], meta["kv_seq_lens"])
    keys, valid = hca.attention_keys(m, kv_cache, cmp_kv, *args)
    got = attention.sparse_attention(q, keys, valid, sink, m.softmax_scale)
    want = naive_attention(q, kv_cache, cmp_kv, *args, sink, m)
    assert torch.equal(got, want)
    # The row committed by a boundary token is a key of that token and the later ones only.
    n_cmp = valid[:, 128:].sum(dim=1).view(len(starts), 8)
    expect = [[min((st + s + 1) // RATIO, 8192) for s in range(8)] for st in starts]
    assert n_cmp.tolist() == expect


# -- the layer: forward, fixture, validation --------------------------------------------------
def _run(case, fn, rank=0):
    tensors = {n: x.clone() for n, x in hca.LAYER.rank_inputs(case, rank).items()}
    return fn(tensors)


# One request at the 1M-token ceiling: its golden serves two tests (a step takes seconds).
CEILING = Case("hca", TINY, 1, 8, 11, (LONG - 8,))


@functools.cache
def _golden(case):
    return _run(case, lambda x: hca.LAYER.golden(case, x))


@pytest.mark.parametrize(
    "case",
    [Case("hca", TINY, 1, 32, 11, (16376, 16376, 131064, 524280)), CEILING],
    ids=["mixed-long", "1M-ceiling"],
)
def test_tp1_forward_equals_golden_bitwise_at_long_contexts(case):
    validated(case)
    ctx = RankContext(case, 0, CPU)
    inputs = hca.LAYER.rank_inputs(case, 0)
    golden = _golden(case)
    forward = _run(case, lambda x: hca.LAYER.forward(ctx, x))
    for name in ("x_out", "compress_state", "kv_cache", "cmp_kv"):
        assert torch.equal(forward[name], golden[name]), name
    # The step wrote each pool: state rows always, the caches where the mappings say.
    for name in ("compress_state", "kv_cache"):
        assert not torch.equal(golden[name], inputs[name]), name
    assert torch.equal(golden["cmp_kv"], inputs["cmp_kv"]) == bool((inputs["cmp_slot_mapping"] < 0).all())


def test_1m_context_commits_the_last_row_and_sees_all_8192():
    x = hca.LAYER.rank_inputs(CEILING, 0)
    assert x["cmp_block_table"].tolist() == [list(range(256))]
    assert x["cmp_slot_mapping"].tolist() == [-1] * 7 + [255 * 32 + 31]
    out = _golden(CEILING)
    assert not torch.equal(out["cmp_kv"].view(-1, 64)[8191], x["cmp_kv"].view(-1, 64)[8191])
    assert torch.isfinite(out["x_out"]).all()


def test_one_canonical_fixture_replicates_all_but_x_hc_and_the_o_shards():
    """§6.3: every rank holds the same tensors but its own x_hc and O-projection shards."""
    case = Case("hca", TINY, 2, 64, 7)
    stacked = hca_fixture.stacked_inputs(case)
    for name in stacked:
        if name not in ("x_hc", "wo_a", "wo_b", "local_t"):
            assert torch.equal(stacked[name][0], stacked[name][1]), name
    assert not torch.equal(stacked["x_hc"][0], stacked["x_hc"][1])


def test_fixture_values_follow_the_recipes():
    case = Case("hca", TINY, 2, 64, 1)
    x = hca.LAYER.rank_inputs(case, 0)
    assert (x["x_hc"].abs() <= 1).all() and x["x_hc"].std() > 0.5
    assert abs(x["hc_attn_fn"].std().item() - hca_fixture.HC_ATTN_FN_STD) < 0.002
    assert abs(x["cmp_norm_w"].float().mean().item() - hca_fixture.CMP_NORM_W_MEAN) < 0.02
    rms = x["kv_cache"].float().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=0.01)
    assert not x["compress_state"].any() and not x["attn_sink"].any()
    wo_b_f = x["wo_b"].float() * x["wo_b_scale"][:, None]
    assert x["wo_b"].abs().max() <= 127 and wo_b_f.std() > 0


def test_checks_are_validation_12_2_in_order():
    checks = hca.LAYER.checks(Case("hca", TINY, 2, 64, 0))
    assert [c.output for c in checks] == ["compress_state", "kv_cache", "cmp_kv", "x_out"]
    assert checks[0] == PoolCheck("compress_state", "state_slot_mapping", 8, 1e-3, 1 / 128, 0.005, "compressor state")
    assert checks[1] == PoolCheck("kv_cache", "ori_slot_mapping", 32, 1e-3, 1 / 128, 0.005, "original KV cache")
    assert checks[2] == PoolCheck("cmp_kv", "cmp_slot_mapping", 32, 1e-3, 1 / 128, 0.005, "compressed KV cache")
    assert checks[3] == RelDiffCheck("x_out", 3e-3, 0.008, 1.0, axes=HIDDEN_AXES)


@pytest.mark.parametrize(
    "case, message",
    [
        (Case("hca", TINY, 1, 8, 0, (LONG - 7,)), "context ceiling 1048576"),
        (Case("hca", TINY, 1, 16, 0, (LONG - 8, LONG - 8)), "need 512 pages of 32, kv_cmp_block_num is 256"),
        (Case("hca", TINY.replace(kv_ori_block_num=40), 1, 128, 0), "need 64 pages, kv_ori_block_num is 40"),
        (Case("hca", TINY.replace(hca_state_physical_blocks=8), 1, 128, 0), "cannot hold the 128 state rows"),
        (Case("hca", TINY, 2, 72, 0), "local_t=72"),
    ],
)
def test_validate_rejects_with_one_line(case, message):
    with pytest.raises(ConfigError, match=message) as err:
        validated(case)
    assert "\n" not in str(err.value)


def test_validate_accepts_the_tiny_preset_at_every_tp():
    for tp in (1, 2, 4, 8):
        validated(Case("hca", TINY, tp, TINY.decode_tokens // tp, 0))
