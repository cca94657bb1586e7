"""The CSA lightning indexer against loop re-statements of csa.md §4.6 / §4.7.

Covers the int8 index-cache commit (bf16 row → Hadamard → bf16 → RNE int8 with scale
1/(127/amax)), the fixture's Sylvester Hadamard, the indexer query, the per-head weights,
the exact int8 scores with their scale placement, the causal visible-slot limits and the
top-k (descending score, ascending slot on ties, −1 padding).
"""

from __future__ import annotations

import math

import pytest
import torch

from layers.csa import fixture as csa_fixture
from layers.components import indexer, rope
from layers.contract.case import Case
from layers.contract.config import TINY
from layers.components.numerics import bf16

M = TINY
SEQ = M.decode_seq


def naive_hadamard(n: int) -> torch.Tensor:
    """Sylvester: H[i, j] = (−1)^popcount(i & j) / √n."""
    return torch.tensor([[(-1) ** bin(i & j).count("1") / math.sqrt(n) for j in range(n)] for i in range(n)])


def naive_quant_row(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RNE int8 of one fp32 row: amax floored at 1e-4, sq = 127/amax, q = round_half_even(v·sq).

    `127.0 / tensor` is what the reference golden writes; torch evaluates a float divided by a
    tensor as `reciprocal(tensor) · 127`, and those are the reference's bits (the snapshot's
    idx_kv_scale agrees), so the restatement uses the same expression.
    """
    amax = max(float(v.abs().max()), 1e-4)
    sq = 127.0 / torch.tensor(amax, dtype=torch.float32)
    q = [round(float(e * sq)) for e in v]  # Python round is half-to-even
    return torch.tensor(q, dtype=torch.int8), (torch.tensor(1.0, dtype=torch.float32) / sq).reshape(1)


def test_fixture_hadamard_is_sylvester():
    for n in (2, 8, 32, 128):
        assert torch.equal(csa_fixture.hadamard(n), naive_hadamard(n).float())


def test_commit_idx_rows_rotates_rounds_and_quantizes():
    g = torch.Generator().manual_seed(2)
    idd = M.index_head_dim
    rows = torch.randn(6, idd, generator=g)
    rows[3] = 0.0  # an all-zero row: q = 0, scale 1e-4/127
    had = bf16(csa_fixture.hadamard(idd))
    cache = torch.full((4, 32, 1, idd), 7, dtype=torch.int8)
    scale = torch.full((4, 32, 1, 1), 0.5)
    slots = torch.tensor([5, -1, 64, 70, 127, 0])
    indexer.commit_idx_rows(cache, scale, slots, rows, had)
    flat_q, flat_s = cache.view(-1, idd), scale.view(-1)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        v = (bf16(rows[i]).float() @ had.float()).bfloat16().float()
        q, s = naive_quant_row(v)
        assert torch.equal(flat_q[slot], q), i
        assert torch.equal(flat_s[slot : slot + 1], s), i
    written = {5, 64, 70, 127, 0}
    others = [r for r in range(flat_q.shape[0]) if r not in written]
    assert (flat_q[others] == 7).all() and (flat_s[others] == 0.5).all()
    assert torch.equal(flat_q[70], torch.zeros(idd, dtype=torch.int8))


def test_fixture_index_cache_scales_are_reciprocal_of_quant_scale():
    """§6.4 / pitfall 12: the cache's dequant scale is 1/(127/amax), values RNE of the bf16 row."""
    case = Case("csa", M, 1, M.decode_tokens, seed=4)
    starts = csa_fixture.global_starts(case)
    pools = csa_fixture.replicated_pools(case, starts, *csa_fixture.state_tables(case, starts))
    shape = (M.idx_cache_block_num, 32, 1, M.index_head_dim)
    raw = bf16(csa_fixture.normalized_cache(shape, M.rms_norm_eps, 4, "idx_kv_cache"))
    for row in (0, 1, 4000, 8191):
        q, s = naive_quant_row(raw.view(-1, M.index_head_dim)[row].float())
        assert torch.equal(pools["idx_kv_cache"].view(-1, M.index_head_dim)[row], q)
        assert torch.equal(pools["idx_kv_scale"].view(-1)[row : row + 1], s)


@pytest.fixture(scope="module")
def query_inputs():
    g = torch.Generator().manual_seed(8)
    t, ql, ih, idd = 2 * SEQ, M.q_lora_rank, M.index_n_heads, M.index_head_dim
    qr = torch.randint(-127, 128, (t, ql), generator=g, dtype=torch.int8)
    qr_scale = torch.rand(t, 1, generator=g) * 1e-3
    w = torch.randint(-127, 128, (ql, ih * idd), generator=g, dtype=torch.int8)
    w_scale = torch.rand(ih * idd, generator=g) * 1e-2
    base, original = rope.rope_profile(M, 4)
    cos, sin = rope.precompute_freqs_cos_sin(
        M.qk_rope_head_dim, 1024, original, base, M.rope_factor, M.beta_fast, M.beta_slow
    )
    first = torch.tensor([130, 517])
    step_cos, step_sin = cos[first].repeat_interleave(SEQ, 0), sin[first].repeat_interleave(SEQ, 0)
    return qr, qr_scale, w, w_scale, step_cos, step_sin, bf16(csa_fixture.hadamard(idd))


def test_query_matches_loop_restatement(query_inputs):
    qr, qr_scale, w, w_scale, step_cos, step_sin, had = query_inputs
    q, q_scale = indexer.query(M, qr, qr_scale, w, w_scale, step_cos, step_sin, had)
    ih, idd, n, r = M.index_n_heads, M.index_head_dim, M.index_nope_head_dim, M.qk_rope_head_dim
    for t in range(qr.shape[0]):
        for h in range(ih):
            cols = slice(h * idd, (h + 1) * idd)
            columns = range(h * idd, (h + 1) * idd)
            dots = torch.tensor([sum(int(a) * int(b) for a, b in zip(qr[t], w[:, c])) for c in columns])
            v = (dots.float() * qr_scale[t]) * w_scale[cols]
            head = bf16(v).float()
            for i in range(r // 2):
                c, s = step_cos[t, i].float(), step_sin[t, i].float()
                e, o = v[n + 2 * i], v[n + 2 * i + 1]
                head[n + 2 * i], head[n + 2 * i + 1] = bf16(e * c - o * s).float(), bf16(e * s + o * c).float()
            rotated = head @ had.float()
            expected_q, expected_s = naive_quant_row(rotated)
            # The Hadamard GEMM may sum in another order than the row product: at most one
            # element may sit on a rounding boundary.
            assert (q[t, h].int() - expected_q.int()).abs().max() <= 1
            assert (q[t, h] != expected_q).sum() <= 1
            torch.testing.assert_close(q_scale[t, h], expected_s, rtol=1e-6, atol=0)
    # Every token of a request uses the request's step row: same angle for all S tokens.
    assert torch.equal(step_cos[0], step_cos[SEQ - 1])


def test_head_weights_scale():
    g = torch.Generator().manual_seed(4)
    x = bf16(torch.randn(5, M.hidden_size, generator=g))
    wp = bf16(torch.randn(M.hidden_size, M.index_n_heads, generator=g) * 0.2)
    got = indexer.head_weights(M, x, wp)
    expected = (x.double() @ wp.double()) * (M.index_head_dim**-0.5 * M.index_n_heads**-0.5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_scores_match_loop_restatement():
    g = torch.Generator().manual_seed(6)
    b, ih, idd, bs = 2, M.index_n_heads, M.index_head_dim, M.block_size
    q = torch.randint(-127, 128, (b * SEQ, ih, idd), generator=g, dtype=torch.int8)
    q_scale = torch.rand(b * SEQ, ih, 1, generator=g) * 1e-2
    weights = torch.randn(b * SEQ, ih, generator=g)
    cache = torch.randint(-127, 128, (6, bs, 1, idd), generator=g, dtype=torch.int8)
    cache_scale = torch.rand(6, bs, 1, 1, generator=g) * 0.03
    table = torch.tensor([[4, 1, 5], [2, 0, 3]], dtype=torch.int32)
    n_slots = 70
    got = indexer.scores(M, q, q_scale, weights, cache, cache_scale, table, n_slots)
    for t in range(b * SEQ):
        req = t // SEQ
        for u in range(0, n_slots, 7):
            row = int(table[req, u // bs]) * bs + u % bs
            k = cache.view(-1, idd)[row]
            acc = torch.zeros((), dtype=torch.float32)
            for h in range(ih):
                dot = sum(int(a) * int(c) for a, c in zip(q[t, h], k))
                acc = acc + torch.relu(torch.tensor(float(dot)) * q_scale[t, h, 0]) * weights[t, h]
            expected = acc * cache_scale.view(-1)[row]
            torch.testing.assert_close(got[t, u], expected, rtol=1e-6, atol=1e-9)


def test_visible_slots_are_causal_and_capped():
    positions = torch.tensor([0, 1, 2, 3, 4, 7, 8199, 8200])
    lens = torch.tensor([8, 8200, 8200, 8, 8, 8, 8200, 3])
    model = M.replace(decode_seq=1)
    got = indexer.visible_slots(model, positions, lens)
    expected = [min(int(n) // 4, (int(p) + 1) // 4, M.max_position_embeddings // 4) for p, n in zip(positions, lens)]
    assert got.tolist() == expected
    capped = indexer.visible_slots(model.replace(max_position_embeddings=64), positions, lens)
    assert capped.max() == 16


def naive_topk(score_row, visible, k):
    order = sorted(range(visible), key=lambda u: (-float(score_row[u]), u))[:k]
    return order + [-1] * (k - len(order))


def test_topk_ties_break_by_ascending_slot():
    score = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.5], [1.0, 3.0, 3.0, 2.0, 3.0, 0.5], [5.0] * 6])
    visible = torch.tensor([5, 2, 0])
    got = indexer.select_topk(score, visible, 4)
    assert got.dtype == torch.int32
    assert got.tolist() == [[1, 2, 4, 3], [1, 0, -1, -1], [-1, -1, -1, -1]]
    # Slots beyond `visible` never compete, whatever their score.
    score[0, 5] = 100.0
    assert indexer.select_topk(score, visible, 4)[0].tolist() == [1, 2, 4, 3]


def test_topk_matches_naive_on_heavy_ties():
    g = torch.Generator().manual_seed(12)
    score = torch.randint(0, 5, (40, 90), generator=g).float() * 0.25
    visible = torch.randint(0, 91, (40,), generator=g)
    for k in (1, 16, 128):
        got = indexer.select_topk(score, visible, k)
        for t in range(40):
            assert got[t].tolist() == naive_topk(score[t], int(visible[t]), k), (k, t)
