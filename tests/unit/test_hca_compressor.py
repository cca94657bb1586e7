"""The ratio-128 compressor (hca.md §4.4, §10.1-§10.3) against a loop re-statement of the spec.

`naive_compress` walks the spec's pseudo-code one request, one token and one window position
at a time and pools in float64, so it shares no code (and no summation order) with
`layers.components.hca_compressor`. State rows are copies of the fp32 projections and must match
exactly; committed cmp_kv rows are bf16 roundings of a pooled fp32 row and must match within
the comparator's tolerance (1 bf16 ulp), while every row the step must not write stays
bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch

from layers.hca import fixture as hca_fixture
from layers.components import hca_compressor
from layers.contract.case import Case
from layers.contract.config import TINY

RATIO = 128
# TINY with the FLASH decode batch, so a rank can hold the odd batch 31 of §10.1.
WIDE = TINY.replace(name="tiny-wide", decode_batch=64)


# -- the spec's pseudo-code, one step at a time ------------------------------------------------
def naive_compress(
    model, x_normed, w, state, table, cmp_kv, positions, state_slots, cmp_slots, order=None, pool_after_all=False
):
    """§4.4 Steps A-C literally; `order` / `pool_after_all` give the wrong orders §10.1 warns of."""
    seq, sb, od = model.decode_seq, model.c128_state_block_size, model.head_dim
    rows = state.view(-1, 2 * od)
    flat_cmp = cmp_kv.view(-1, od)
    xn = x_normed.float()
    kvp = xn @ w["cmp_wkv"].float().t()
    scp = xn @ w["cmp_wgate"].float().t()
    batch = len(positions) // seq
    pooled = {}

    def pool(b, cp):
        ks, gs = [], []
        for q in range(cp - RATIO + 1, cp + 1):
            pg = int(table[b, q // sb])
            if pg < 0:
                ks.append(torch.zeros(od, dtype=torch.float64))
                gs.append(torch.full((od,), -math.inf, dtype=torch.float64))
            else:
                ks.append(rows[pg * sb + q % sb, :od].double())
                gs.append(rows[pg * sb + q % sb, od:].double())
        k, g = torch.stack(ks), torch.stack(gs)
        e = torch.exp(g - g.max(dim=0).values)
        pooled[b] = (k * e / e.sum(dim=0)).sum(dim=0)

    boundaries = {}
    for b in order if order is not None else range(batch):
        boundary = None
        for s in range(seq):
            t = b * seq + s
            p = int(positions[t])
            score = scp[t] + w["cmp_ape"][p % RATIO]
            r = int(state_slots[t])
            if r >= 0:
                rows[r, :od] = kvp[t]
                rows[r, od:] = score
            if (p + 1) % RATIO == 0:
                boundary = s
        if boundary is not None:
            boundaries[b] = boundary
            if not pool_after_all:
                pool(b, int(positions[b * seq + boundary]))
    if pool_after_all:
        for b, s in boundaries.items():
            pool(b, int(positions[b * seq + s]))

    r_dim = model.qk_rope_head_dim
    for b, v in pooled.items():
        y = v / torch.sqrt((v * v).mean() + model.rms_norm_eps) * w["cmp_norm_w"].double()
        for i in range(r_dim // 2):
            c, s_ = float(w["cmp_freqs_cos"][b, i]), float(w["cmp_freqs_sin"][b, i])
            e_, o_ = float(y[od - r_dim + 2 * i]), float(y[od - r_dim + 2 * i + 1])
            y[od - r_dim + 2 * i] = e_ * c - o_ * s_
            y[od - r_dim + 2 * i + 1] = e_ * s_ + o_ * c
        first = min(s for s in range(seq) if (int(positions[b * seq + s]) + 1) % RATIO == 0)
        slot = int(cmp_slots[b * seq + first])
        if slot >= 0:
            flat_cmp[slot] = y.to(torch.bfloat16)


# -- fixtures ------------------------------------------------------------------------------------
def _step(model, starts, seed=0, prefill_state=False):
    """A compressor step's tensors for `starts` on one rank, with the layer's own metadata."""
    tp = 1 if len(starts) <= model.decode_batch else 2
    case = Case("hca", model, tp, len(starts) * model.decode_seq, seed, tuple(starts))
    meta = hca_fixture.rank_metadata(case, list(starts))
    g = torch.Generator().manual_seed(seed)
    d, od = model.hidden_size, model.head_dim
    t = len(starts) * model.decode_seq
    state = torch.zeros(model.hca_state_physical_blocks, model.c128_state_block_size, 2 * od)
    if prefill_state:  # earlier steps' rows, so pooling windows see real history
        state.normal_(generator=g)
    w = {
        "cmp_wkv": (torch.randn(od, d, generator=g) * 0.024).bfloat16(),
        "cmp_wgate": (torch.randn(od, d, generator=g) * 0.0309).bfloat16(),
        "cmp_ape": torch.randn(RATIO, od, generator=g) * 0.0332,
        "cmp_norm_w": (0.0982 + 0.0539 * torch.randn(od, generator=g)).bfloat16(),
        "cmp_freqs_cos": meta["cmp_freqs_cos"],
        "cmp_freqs_sin": meta["cmp_freqs_sin"],
    }
    return {
        "x_normed": torch.randn(t, d, generator=g).bfloat16(),
        "w": w,
        "state": state,
        "cmp_kv": torch.randn(model.kv_cmp_block_num, model.block_size, 1, od, generator=g).bfloat16(),
        **{
            n: meta[n]
            for n in ("compress_state_block_table", "position_ids", "state_slot_mapping", "cmp_slot_mapping")
        },
    }


def _run_layer(model, st):
    state, cmp_kv = st["state"].clone(), st["cmp_kv"].clone()
    w = st["w"]
    hca_compressor.compress(
        model, st["x_normed"], w["cmp_wkv"], w["cmp_wgate"], w["cmp_ape"], w["cmp_norm_w"], w["cmp_freqs_cos"],
        w["cmp_freqs_sin"], state, st["compress_state_block_table"], cmp_kv, st["position_ids"],
        st["state_slot_mapping"], st["cmp_slot_mapping"],
    )  # fmt: skip
    return state, cmp_kv


def _run_naive(model, st, **kw):
    state, cmp_kv = st["state"].clone(), st["cmp_kv"].clone()
    naive_compress(
        model, st["x_normed"], st["w"], state, st["compress_state_block_table"], cmp_kv, st["position_ids"],
        st["state_slot_mapping"], st["cmp_slot_mapping"], **kw,
    )  # fmt: skip
    return state, cmp_kv


def _assert_cmp_kv_matches(got, want, initial, slots):
    written = torch.zeros(got.view(-1, got.shape[-1]).shape[0], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    g, w_, i = (x.view(-1, x.shape[-1]) for x in (got, want, initial))
    assert torch.equal(g[~written], i[~written]), "cmp_kv rows outside cmp_slot_mapping changed"
    # One bf16 rounding of an fp32 pooled row vs a float64 one: at most one ulp apart.
    torch.testing.assert_close(g[written].float(), w_[written].float(), rtol=1 / 128, atol=1e-3)


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "starts",
    [
        [120, 127, 300, 1000],  # boundary on the last and on the first token; two without
        [8192, 127, 128, 255, 7, 10],  # the canonical set (hca.md §5.1)
        [200, 300, 1001, 5],  # no boundary at all: no cmp_kv write
    ],
)
def test_step_matches_the_spec_loop(starts):
    st = _step(TINY, starts, prefill_state=True)
    state, cmp_kv = _run_layer(TINY, st)
    n_state, n_cmp = _run_naive(TINY, st)
    assert torch.equal(state, n_state)
    _assert_cmp_kv_matches(cmp_kv, n_cmp, st["cmp_kv"], st["cmp_slot_mapping"])
    commits = int((st["cmp_slot_mapping"] >= 0).sum())
    assert commits == sum((s % RATIO) + TINY.decode_seq > RATIO - 1 for s in starts)
    assert torch.equal(cmp_kv, st["cmp_kv"]) == (commits == 0)


def test_boundary_requests_pool_and_commit_slots():
    seq = TINY.decode_seq
    pos = torch.tensor([120, 127, 130, 255, 0], dtype=torch.int32)[:, None] + torch.arange(seq, dtype=torch.int32)
    requests, pool_pos, commit_s = hca_compressor.boundary_requests(pos.reshape(-1), seq)
    assert requests.tolist() == [0, 1, 3]
    assert pool_pos.tolist() == [127, 127, 255]
    assert commit_s.tolist() == [7, 0, 0]


def test_pooling_over_scattered_and_unmapped_state_pages():
    """The 128-position window spans 16 state pages, here scattered over the pool, two unmapped."""
    sb, od = 8, 16
    g = torch.Generator().manual_seed(1)
    state = torch.randn(64, sb, 2 * od, generator=g)
    table = torch.full((2, 64), -1, dtype=torch.int32)
    table[1, 16:32] = torch.randperm(64, generator=g)[:16].to(torch.int32)  # block [128, 255]
    table[1, 20] = -1
    table[1, 27] = -1
    rows = hca_compressor.window_state_rows(table, 1, 255, sb)
    got = hca_compressor.pool_window(state, rows)
    ks, gs = [], []
    for q in range(128, 256):
        pg = int(table[1, q // sb])
        if pg >= 0:  # unmapped rows weigh exp(-inf) = 0 and carry kv 0
            ks.append(state[pg, q % sb, :od].double())
            gs.append(state[pg, q % sb, od:].double())
    k, s = torch.stack(ks), torch.stack(gs)
    want = (k * torch.softmax(s, dim=0)).sum(dim=0)
    assert len(ks) == 128 - 2 * sb
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_zero_state_rows_dilute_the_pool():
    """Never-written rows are zeros (score 0, kv 0), not -inf (hca.md §10.2)."""
    sb, od = 8, 4
    state = torch.zeros(16, sb, 2 * od)
    state[0, 0, :od] = 1.0
    table = torch.arange(16, dtype=torch.int32)[None]
    got = hca_compressor.pool_window(state, hca_compressor.window_state_rows(table, 0, 127, sb))
    torch.testing.assert_close(got, torch.full((od,), 1 / 128))


def test_request_order_is_reproduced_and_matters():
    """Batch 31: the injective state table interleaves the requests' pages (hca.md §10.1)."""
    case = Case("hca", WIDE, 2, 248, 0)
    starts = hca_fixture.canonical_starts(case)
    st = _step(WIDE, starts)
    seq = WIDE.decode_seq
    # The window slots that hit rows other requests write this step, recounted from the
    # tables exactly as the spec did: 48 written by an earlier request, 72 by a later one.
    writer = {int(r): t // seq for t, r in enumerate(st["state_slot_mapping"].tolist()) if r >= 0}
    earlier = later = 0
    requests, pool_pos, _ = hca_compressor.boundary_requests(st["position_ids"], seq)
    for b, p in zip(requests.tolist(), pool_pos.tolist()):
        for r in hca_compressor.window_state_rows(st["compress_state_block_table"], b, p, 8).tolist():
            w = writer.get(r, b)
            earlier += w < b
            later += w > b
    assert (earlier, later) == (48, 72)

    state, cmp_kv = _run_layer(WIDE, st)
    n_state, n_cmp = _run_naive(WIDE, st)
    assert torch.equal(state, n_state)
    slots = st["cmp_slot_mapping"]
    _assert_cmp_kv_matches(cmp_kv, n_cmp, st["cmp_kv"], slots)
    flat = lambda x: x.view(-1, x.shape[-1])[slots[slots >= 0]].float()  # noqa: E731
    for wrong in (dict(order=range(len(starts) - 1, -1, -1)), dict(pool_after_all=True)):
        _, w_cmp = _run_naive(WIDE, st, **wrong)
        moved = ((flat(w_cmp) - flat(cmp_kv)).abs() > 1e-2).any(dim=1).sum()
        assert moved >= 5, f"{wrong}: only {int(moved)} of {len(requests)} committed rows depend on the order"
