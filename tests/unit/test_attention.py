"""Sparse attention, the paged gather and the output packing against loop re-statements.

Two references for the attention math (swa.md §3.5, csa.md §4.9, hca.md §4.6): the golden's
own per-token procedure written as a loop (bitwise: the vectorised code must reproduce the
reference's rounding), and a per-(token, head, key) fp64 scalar loop (the math itself, to a
tolerance that still sees the sink term and the fp32-vs-bf16 exps of l, P6/P19).
"""

from __future__ import annotations

import math

import pytest
import torch

from layers.components import attention
from layers.components import rope
from layers.contract.config import TINY
from layers.components.numerics import bf16

NEG_INF = -1.0e20
TILE = 128


# The golden's exps, as the layer evaluates them: correctly rounded fp32 (see the test below).
EXP = attention.exp_rounded_from_fp64


def golden_loop(q, pool, rows, lens, sink, scale):
    """The golden's per-token procedure: gather a tile at a time, softmax, merge tiles in order."""
    t_count, h, hd = q.shape
    flat = pool.reshape(-1, hd).float()
    out = torch.zeros(t_count, h, hd)
    k_total = rows.shape[1]
    n_tiles = max(1, -(-k_total // TILE))
    for t in range(t_count):
        L = int(lens[t])
        if not any(int(rows[t, k]) >= 0 for k in range(min(L, k_total))):
            continue
        blocks = []
        for j in range(n_tiles):
            kv_tile = torch.zeros(TILE, hd)
            valid = torch.zeros(TILE, dtype=torch.bool)
            for i in range(TILE):
                k = j * TILE + i
                # Only valid rows are loaded: the reference also loads rows past lens, which
                # lets a NaN row there leak through 0·NaN (P4); zeroing them is the fix.
                if k < min(L, k_total) and int(rows[t, k]) >= 0:
                    kv_tile[i] = flat[int(rows[t, k])]
                    valid[i] = True
            s = (q[t].float() @ kv_tile.T) * scale
            s = s.masked_fill(~valid[None], NEG_INF)
            m = s.max(dim=-1, keepdim=True).values
            e = EXP(s - m).masked_fill(~valid[None], 0.0)
            pv = e.to(torch.bfloat16).float() @ kv_tile.to(torch.bfloat16).float()
            blocks.append((m, e.sum(dim=-1, keepdim=True), pv))
        m, l, o = blocks[0]
        for m_j, l_j, o_j in blocks[1:]:
            m_new = torch.maximum(m, m_j)
            a, b = EXP(m - m_new), EXP(m_j - m_new)
            l, o, m = a * l + b * l_j, a * o + b * o_j, m_new
        out[t] = o / (l + EXP(sink.float()[:, None] - m))
    return out


def scalar_loop(q, pool, rows, lens, sink, scale):
    """softmax over {valid keys} ∪ {sink} with values = keys, per token/head/key in fp64.

    The exps feeding the numerator are rounded to bf16 relative to their tile's max (the one
    rounding inside attention); the denominator uses the unrounded exps.
    """
    t_count, h, hd = q.shape
    flat = pool.reshape(-1, hd).double()
    out = torch.zeros(t_count, h, hd, dtype=torch.float64)
    for t in range(t_count):
        keys = [(k, int(rows[t, k])) for k in range(rows.shape[1]) if k < int(lens[t]) and int(rows[t, k]) >= 0]
        if not keys:
            continue
        for hh in range(h):
            qv = q[t, hh].double()
            score = {k: float(qv @ flat[row]) * scale for k, row in keys}
            tile_max = {}
            for k, s in score.items():
                tile_max[k // TILE] = max(tile_max.get(k // TILE, -math.inf), s)
            m = max(score.values())
            den = math.exp(float(sink[hh]) - m)
            num = torch.zeros(hd, dtype=torch.float64)
            for k, row in keys:
                e_tile = math.exp(score[k] - tile_max[k // TILE])
                den += e_tile * math.exp(tile_max[k // TILE] - m)
                e_round = float(torch.tensor(e_tile, dtype=torch.float32).to(torch.bfloat16))
                num += e_round * math.exp(tile_max[k // TILE] - m) * flat[row]
            out[t, hh] = num / den
    return out


def _problem(t_count=7, h=4, hd=16, k_total=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = bf16(torch.randn(t_count, h, hd, generator=g))
    pool = bf16(torch.randn(12, 8, 1, hd, generator=g))  # 96 rows
    rows = torch.randint(0, 96, (t_count, k_total), generator=g, dtype=torch.int32)
    lens = torch.randint(1, k_total + 1, (t_count,), generator=g, dtype=torch.int32)
    sink = torch.tensor([0.5, -1.0, 2.0, 3.0][:h] + [1.0] * max(0, h - 4))
    return q, pool, rows, lens, sink


def _run(q, pool, rows, lens, sink, scale):
    kv, valid = attention.gather_rows(pool, rows)
    in_len = torch.arange(rows.shape[1])[None, :] < lens[:, None]
    return attention.sparse_attention(q, kv, valid & in_len, sink, scale)


def test_gather_rows_zeroes_invalid_and_never_reads_them():
    pool = torch.arange(4 * 2 * 1 * 3, dtype=torch.float32).reshape(4, 2, 1, 3).to(torch.bfloat16)
    pool[3, 1] = float("nan")  # flat row 7
    rows = torch.tensor([[0, 5, -1], [-1, -1, 2]], dtype=torch.int32)
    kv, valid = attention.gather_rows(pool, rows)
    flat = pool.reshape(-1, 3)
    assert valid.tolist() == [[True, True, False], [False, False, True]]
    for t in range(2):
        for k in range(3):
            want = flat[int(rows[t, k])] if int(rows[t, k]) >= 0 else torch.zeros(3, dtype=torch.bfloat16)
            assert torch.equal(kv[t, k], want)
    assert kv.dtype == torch.bfloat16


def test_window_attention_matches_golden_loop_bitwise_with_sink_holes_and_nan():
    q, pool, rows, lens, sink = _problem()
    rows.masked_fill_(rows == 95, 94)
    rows[0, 3] = -1  # a hole inside the valid prefix: excluded (P3)
    rows[1, : int(lens[1])] = -1  # no valid key at all: a skipped token (P1)
    lens[2] = 5
    rows[2, 5:] = 95  # indices past lens point at a NaN row: masked, must not leak (P4)
    pool.reshape(-1, pool.shape[-1])[95] = float("nan")
    scale = 16**-0.5
    got = _run(q, pool, rows, lens, sink, scale)
    want = golden_loop(q, pool, rows, lens, sink, scale)
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(got, want)


def test_window_attention_matches_scalar_math():
    q, pool, rows, lens, sink = _problem(seed=1)
    scale = 16**-0.5
    got = _run(q, pool, rows, lens, sink, scale).double()
    want = scalar_loop(q, pool, rows, lens, sink, scale)
    # fp32 vs fp64 evaluation only (a rare bf16 tie of an exp aside): 2e-5 relative. The
    # sink term here moves outputs by tens of percent, bf16 exps in l (P6) by ~2e-3.
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    no_sink = _run(q, pool, rows, lens, torch.full_like(sink, -1e30), scale).double()
    assert (no_sink - want).abs().max() > 1e-2


@pytest.mark.parametrize("k_total", [300, 256])
def test_multi_tile_merge_matches_golden_loop_bitwise(k_total):
    q, pool, rows, lens, sink = _problem(t_count=6, k_total=k_total, seed=2)
    lens[:] = k_total
    rows[0, :TILE] = -1  # first tile all invalid: the merge must take tile 1's max
    rows[1, TILE : 2 * TILE] = -1  # a middle tile all invalid: vanishes in the merge
    lens[2] = TILE + 7  # the last tiles are past lens
    scale = 16**-0.5
    got = _run(q, pool, rows, lens, sink, scale)
    assert torch.equal(got, golden_loop(q, pool, rows, lens, sink, scale))
    torch.testing.assert_close(got.double(), scalar_loop(q, pool, rows, lens, sink, scale), rtol=2e-5, atol=1e-6)


def test_short_window_pads_to_one_tile():
    # WIN < 128: invalid zero columns up to the tile (swa.md §3.5), same bits as the loop.
    q, pool, rows, lens, sink = _problem(k_total=20, seed=3)
    scale = 16**-0.5
    assert torch.equal(_run(q, pool, rows, lens, sink, scale), golden_loop(q, pool, rows, lens, sink, scale))


def test_token_chunking_does_not_change_bits(monkeypatch):
    q, pool, rows, lens, sink = _problem(t_count=9, seed=4)
    scale = 16**-0.5
    whole = _run(q, pool, rows, lens, sink, scale)
    monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", 2 * TILE * 16)  # 2 tokens per chunk
    assert torch.equal(_run(q, pool, rows, lens, sink, scale), whole)


def test_pack_heads_layout_and_inverse_rope():
    m = TINY
    t_count, h, hd, nope, r = 3, m.num_attention_heads, m.head_dim, m.nope_head_dim, m.qk_rope_head_dim
    hpg = m.heads_per_group
    g = torch.Generator().manual_seed(5)
    o = torch.randn(t_count, h, hd, generator=g)
    cos, sin = rope.rope_rows(m, torch.tensor([0, 77, 8191]), 0)
    packed = attention.pack_heads(o, cos, sin, m)
    assert packed.shape == (m.o_groups, t_count, m.group_in) and packed.dtype == torch.bfloat16
    f = torch.float32
    for t in range(t_count):
        for hh in range(h):
            head = packed[hh // hpg, t, (hh % hpg) * hd : (hh % hpg + 1) * hd]
            assert torch.equal(head[:nope], o[t, hh, :nope].to(torch.bfloat16))
            for i in range(r // 2):
                c, s = cos[t, i].to(f), sin[t, i].to(f)
                e, od = o[t, hh, nope + 2 * i], o[t, hh, nope + 2 * i + 1]
                assert head[nope + 2 * i] == (e * c + od * s).to(torch.bfloat16)
                assert head[nope + 2 * i + 1] == (od * c - e * s).to(torch.bfloat16)
    # Inverse of the forward rotation: rotating back recovers the rope part (to bf16 noise).
    rope_part = packed.reshape(m.o_groups, t_count, hpg, hd).transpose(0, 1).reshape(t_count, h, hd)[..., nope:]
    restored = rope.apply_rope(rope_part.float(), cos, sin).float()
    torch.testing.assert_close(restored, o[..., nope:], rtol=0.02, atol=0.02)


def test_default_exp_is_the_correctly_rounded_fp32_exp():
    x = torch.linspace(-87.0, 0.0, 20001)
    want = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64).to(torch.float32)
    assert torch.equal(attention.exp_rounded_from_fp64(x), want)
