"""The CSA ratio-4 compressor against a loop re-statement of csa.md §4.5 (and its §9 pitfalls).

The naive step below walks requests and positions one by one with the state as a plain row
table, exactly as the spec text reads; the code under test is `layers.csa.layer.compressor_rows`
(vectorized per step, a loop over requests only) with the commit of `layers.components.csa_compressor`.
"""

from __future__ import annotations

import pytest
import torch

from layers.csa import layer as csa
from layers.components import csa_compressor
from layers.csa import fixture as csa_fixture
from layers.components import metadata
from layers.contract.case import Case
from layers.contract.config import TINY
from layers.components.numerics import bf16

SEQ = TINY.decode_seq


def naive_compressor_step(model, x_normed, wkv, wgate, ape, norm_w, state, table, slots, positions, cos, sin):
    """csa.md §4.5 with loops: returns {request: (boundary_s, y fp32 [dim])}; mutates `state`."""
    seq = model.decode_seq
    out = wkv.shape[0]
    dim = out // 2
    r = cos.shape[1]
    sb = state.shape[1]
    rows = state.view(-1, state.shape[-1])
    x = x_normed.float()
    kv = x @ wkv.float().t()
    score = x @ wgate.float().t()
    pooled = {}
    for b in range(x.shape[0] // seq):
        for s in range(seq):
            t = b * seq + s
            p = int(positions[t])
            score[t] = score[t] + ape[p % 4]
            row = int(slots[t])
            if row >= 0:
                rows[row, :out] = kv[t]
                rows[row, out:] = score[t]
        f = int(positions[b * seq])
        m = f % 4
        boundary = 3 - m
        if not 0 <= boundary < seq:
            continue
        e = f + min(seq, 4 - m) - 1
        cur = e - 3
        prev = cur - 4
        values, logits = [], []
        for i in range(8):
            a = prev + i if i < 4 else cur + i - 4
            half = slice(0, dim) if i < 4 else slice(dim, out)
            entry = int(table[b, a // sb]) if a >= 0 else -1
            if entry < 0:
                values.append(torch.zeros(dim))
                logits.append(torch.full((dim,), float("-inf")))
            else:
                row = entry * sb + a % sb
                values.append(rows[row, half].clone())
                logits.append(rows[row, out:][half].clone())
        top = torch.stack(logits).amax(dim=0)
        weights = [torch.exp(lg - top) for lg in logits]
        total = sum(weights)
        y = sum(w / total * v for w, v in zip(weights, values))
        y = y * torch.rsqrt(y.pow(2).mean() + model.rms_norm_eps) * norm_w.float()
        for i in range(r // 2):
            c, s_ = cos[b, i].float(), sin[b, i].float()
            e0, o0 = y[dim - r + 2 * i].clone(), y[dim - r + 2 * i + 1].clone()
            y[dim - r + 2 * i] = e0 * c - o0 * s_
            y[dim - r + 2 * i + 1] = e0 * s_ + o0 * c
        pooled[b] = (boundary, y)
    return pooled


@pytest.fixture(scope="module")
def tiny_rank():
    """The tiny fixture at tp=1 (global batch 16: the reference snapshot's request pattern)."""
    case = Case("csa", TINY, 1, TINY.decode_tokens, seed=11)
    x = csa.LAYER.rank_inputs(case, 0)
    x["x_normed"] = bf16(torch.randn(case.local_t, TINY.hidden_size, generator=torch.Generator().manual_seed(5)))
    return case, x


def _main_args(x):
    first = x["position_ids"].long()[::SEQ]
    cmp_pos = first - first % 4
    return (
        (x["cmp_wkv"], x["cmp_wgate"], x["cmp_ape"], x["cmp_norm_w"]),
        x["compress_state"].clone(), x["compress_state_block_table"], x["state_slot_mapping"],
        x["freqs_cos"][cmp_pos], x["freqs_sin"][cmp_pos],
    )  # fmt: skip


def _run(case, x, weights, state, table, slots, cos, sin):
    return csa.compressor_rows(
        case.model, x["x_normed"], weights, state, table, slots, x["position_ids"], cos, sin
    )


def test_commit_step_matches_loop_restatement(tiny_rank):
    case, x = tiny_rank
    weights, state, table, slots, cos, sin = _main_args(x)
    naive_state = state.clone()
    rows = _run(case, x, weights, state, table, slots, cos, sin)
    expected = naive_compressor_step(
        case.model, x["x_normed"], *weights, naive_state, table, slots, x["position_ids"], cos, sin
    )
    # State rows are plain copies of fp32 projections: bit-identical.
    assert torch.equal(state.view(torch.int32), naive_state.view(torch.int32))
    assert sorted(expected) == list(range(case.batch))
    for b, (_, y) in expected.items():
        torch.testing.assert_close(rows[b], y, rtol=2e-6, atol=1e-6)

    cmp_kv = x["cmp_kv"].clone()
    first = x["position_ids"].long()[::SEQ]
    committed = csa_compressor.commit_slots(first, x["cmp_slot_mapping"], SEQ)
    csa_compressor.commit_cmp_rows(cmp_kv, committed, rows)
    flat, before = cmp_kv.view(-1, cmp_kv.shape[-1]), x["cmp_kv"].view(-1, cmp_kv.shape[-1])
    for b, (boundary, y) in expected.items():
        row = int(x["cmp_slot_mapping"][b * SEQ + boundary])
        assert int(committed[b]) == row
        assert torch.equal(flat[row], bf16(rows[b]))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[committed] = False
    assert torch.equal(flat[untouched], before[untouched])


def test_only_the_first_boundary_is_committed(tiny_rank):
    """§9 pitfall 1: the second boundary token has a cmp slot, but its row is never written."""
    case, x = tiny_rank
    first = x["position_ids"].long()[::SEQ]
    committed = csa_compressor.commit_slots(first, x["cmp_slot_mapping"], SEQ)
    slots = x["cmp_slot_mapping"].view(-1, SEQ)
    boundary = 3 - first % 4
    second = slots[torch.arange(case.batch), boundary + 4]
    assert (second >= 0).all(), "every S=8 request has a second boundary slot"
    assert not set(second.tolist()) & set(committed.tolist())
    assert torch.equal(committed, slots[torch.arange(case.batch), boundary])


def test_no_commit_when_the_boundary_is_past_the_step():
    """With S = 2 a request starting at f mod 4 in {0, 1} has no boundary: state written, no row pooled."""
    model = TINY.replace(decode_seq=2)
    starts = [0, 1, 2, 5, 7]
    positions = metadata.position_ids_from_starts(starts, 2)
    table = csa_fixture.active_state_block_table(starts, 2, csa_fixture.state_table_cols(model), 16, 2, "test")
    slots = metadata.state_slot_mapping(positions, table, 2).reshape(-1)
    first = positions[:, 0].long()
    boundary, commit = csa_compressor.first_boundary(first, 2)
    assert commit.tolist() == [False, False, True, False, True]
    g = torch.Generator().manual_seed(3)
    out, d = 2 * model.head_dim, model.hidden_size
    weights = (
        bf16(torch.randn(out, d, generator=g) * 0.03), bf16(torch.randn(out, d, generator=g) * 0.03),
        torch.randn(4, out, generator=g) * 0.1, bf16(1 + 0.1 * torch.randn(model.head_dim, generator=g)),
    )  # fmt: skip
    state = torch.randn(16, 2, 2 * out, generator=g) * 0.05
    x_normed = bf16(torch.randn(positions.numel(), d, generator=g))
    freqs_cos, freqs_sin = _tables(model)
    cos, sin = freqs_cos[first - first % 4], freqs_sin[first - first % 4]
    naive_state = state.clone()
    pos = positions.reshape(-1)
    rows = csa.compressor_rows(model, x_normed, weights, state, table, slots, pos, cos, sin)
    expected = naive_compressor_step(model, x_normed, *weights, naive_state, table, slots, pos, cos, sin)
    assert torch.equal(state, naive_state)
    assert sorted(expected) == [2, 4]
    for b, (_, y) in expected.items():
        torch.testing.assert_close(rows[b], y, rtol=2e-6, atol=1e-6)
    cmp_slots = torch.arange(positions.numel(), dtype=torch.int64)  # every token a distinct row
    committed = csa_compressor.commit_slots(first, cmp_slots, 2)
    assert committed.tolist() == [-1, -1, 2 * 2 + 1, -1, 4 * 2 + 0]


def _tables(model):
    from layers.components import rope

    base, original = rope.rope_profile(model, 4)
    return rope.precompute_freqs_cos_sin(
        model.qk_rope_head_dim, model.max_position_embeddings, original, base, model.rope_factor, model.beta_fast,
        model.beta_slow,
    )  # fmt: skip


def _aliased_requests(x, batch):
    """Requests whose window reads a row written in this step by another token than its own position."""
    first = x["position_ids"].long()[::SEQ]
    windows = csa_compressor.window_rows(x["compress_state_block_table"], first, 2)
    slots = x["state_slot_mapping"].view(batch, SEQ)
    positions = x["position_ids"].long().view(batch, SEQ)
    cur = first - first % 4
    found = []
    for b in range(batch):
        for i in range(8):
            row = int(windows[b, i])
            if row < 0:
                continue
            pos = int(cur[b]) - 4 + i
            writers = (slots == row).nonzero().tolist()
            if any(int(positions[wb, ws]) != pos or wb != b for wb, ws in writers):
                found.append(b)
    return sorted(set(found))


def test_requests_are_processed_in_order(tiny_rank):
    """§9 pitfall 2: write request b's rows, pool b, then b+1 — 'write all, then pool all' differs here."""
    case, x = tiny_rank
    assert _aliased_requests(x, case.batch), "the fixture must alias a window row onto a current row"
    weights, state, table, slots, cos, sin = _main_args(x)
    in_order = _run(case, x, weights, state.clone(), table, slots, cos, sin)

    # The same step with every request's rows written before any window is read.
    wkv, wgate, ape, norm_w = weights
    first = x["position_ids"].to(torch.int64)[:: case.seq]
    kv, score = csa_compressor.project(x["x_normed"], wkv, wgate, ape, x["position_ids"])
    windows = csa_compressor.window_rows(table, first, state.shape[1])
    state_rows = state.clone().view(-1, state.shape[-1])
    csa_compressor.write_state(state_rows, slots, kv, score)
    pooled = csa_compressor.pool(state_rows[windows.clamp_min(0)], windows, wkv.shape[0] // 2)
    batched = csa_compressor.normalize_rotate(pooled, norm_w, cos, sin, case.model.rms_norm_eps)
    differ = (in_order != batched).any(dim=1).nonzero().flatten().tolist()
    assert differ, "writing all requests before pooling must change some pooled row on this fixture"
    assert set(differ) <= set(_aliased_requests(x, case.batch))


def test_history_reads_see_old_values_of_later_requests():
    """A window row that a later request overwrites in the same step is read before that write."""
    model = TINY
    g = torch.Generator().manual_seed(9)
    out = 2 * model.head_dim
    state_rows = torch.randn(8, 2 * out, generator=g)
    old = state_rows.clone()
    kv, score = torch.randn(2 * SEQ, out, generator=g), torch.randn(2 * SEQ, out, generator=g)
    # Request 0 reads row 5 (written by request 1) and row 1 (its own token 1); request 1 reads row 5.
    slots = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1, 5, -1, -1, -1, -1, -1, -1, -1])
    windows = torch.tensor([[5, 1, -1, -1, -1, -1, -1, -1], [5, -1, -1, -1, -1, -1, -1, -1]])
    gathered = csa_compressor.write_and_gather(state_rows, slots, kv, score, windows)
    assert torch.equal(gathered[0, 0], old[5])
    assert torch.equal(gathered[0, 1], torch.cat((kv[1], score[1])))
    assert torch.equal(gathered[1, 0], torch.cat((kv[8], score[8])))


def test_pool_masks_absent_positions_with_true_minus_inf():
    """Positions < 0 (cold start) are kv 0 / score −inf; front halves for prev, back halves for cur."""
    dim = 4
    g = torch.Generator().manual_seed(1)
    gathered = torch.randn(1, 8, 4 * dim, generator=g)
    windows = torch.tensor([[-1, -1, -1, -1, 7, 8, 9, 10]])
    pooled = csa_compressor.pool(gathered, windows, dim)
    back_kv, back_score = gathered[0, 4:, dim : 2 * dim], gathered[0, 4:, 3 * dim :]
    expected = (torch.softmax(back_score, dim=0) * back_kv).sum(dim=0)
    torch.testing.assert_close(pooled[0], expected, rtol=1e-6, atol=1e-7)
    windows = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    pooled = csa_compressor.pool(gathered, windows, dim)
    kv = torch.cat((gathered[0, :4, :dim], back_kv))
    score = torch.cat((gathered[0, :4, 2 * dim : 3 * dim], back_score))
    torch.testing.assert_close(pooled[0], (torch.softmax(score, dim=0) * kv).sum(dim=0), rtol=1e-6, atol=1e-7)


def test_window_rows_follow_the_table():
    table = torch.tensor([[10, 11, 12, 13, 14, 15]], dtype=torch.int32)
    assert csa_compressor.window_rows(table, torch.tensor([9]), 2).tolist() == [[24, 25, 26, 27, 28, 29, 30, 31]]
    assert csa_compressor.window_rows(table, torch.tensor([2]), 2).tolist() == [[-1, -1, -1, -1, 20, 21, 22, 23]]
    table[0, 2] = -1
    assert csa_compressor.window_rows(table, torch.tensor([8]), 2).tolist() == [[-1, -1, 26, 27, 28, 29, 30, 31]]
