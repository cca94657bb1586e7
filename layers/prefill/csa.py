"""The CSA CP prefill step as its stage list (docs/prefill.md §12; prefill_cp_csa.py), zigzag.

The HCA prefill's list with the two ratio-4 compressors and the indexer in place of the
ratio-128 compressor. Per rank: project its two segments (Q/KV at global positions, the normed
hidden rows the compressors read, the int8 Q latent the indexer reads), cut and exchange the
tails of both the projected KV and the normed hidden rows, then compress: each block ending in
one of the rank's segments pools the 8 positions b−7 … b, those of earlier segments from
their exchanged hidden tails (a window straddles ranks whenever a segment does not start on a
multiple of 4), those before the step from the state pools. The compact exchange sends every
rank's main and indexer rows (with their logical slots) and the final segment's last <= 8
state rows of both compressors (from its owner) to every peer; each rank commits them through
its own block tables. The indexer scores every committed row a query may see and keeps the
top min(top-k, 256); attention reads the window and those rows; then the SWA list's O
projection, hc_post and final-window commit.
"""

from __future__ import annotations

import dataclasses

import torch

from ..components import attention
from ..contract.checks import AllcloseCheck, Check
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import bf16_close, exact, fp32_close, judged
from ..distributed import wire
from . import csa_fixture, csa_math, csa_tables, hca, swa, tables
from .case import MAX_SEGMENT_TILES

POSITIONS = "query_positions"  # the CSA reference's name for the rank's query position table
PAYLOAD_ROWS = tables.LOCAL_PARTS * csa_tables.ROWS_PER_SEGMENT  # compressed rows a rank sends
# What the compact exchange moves: per compressed row its main row, its int8 indexer row and
# scale, its meta (logical slot, −1 none; block end); the final state rows of both compressors
# and their meta (rows, first position).
COMPACT = ("main_payload", "idx_payload", "idx_scale_payload", "record_meta", "main_state_payload",
           "inner_state_payload", "state_meta")
STATE_POOLS = (("compress_state", "compress_state_block_table", csa_math.MAIN, "main_state_payload"),
               ("inner_compress_state", "inner_compress_state_block_table", csa_math.INNER, "inner_state_payload"))


def default_checks() -> tuple[Check, ...]:
    """Every compared tensor; stricter than the reference where the golden allows: HCA's
    kv_cache, cmp_kv, state and x_out checks (the inner state's as the main's) and the
    indexer pool's, each element within one int8 step or 1/128 of its scale, no budget."""
    kv, cmp, state, x = hca.default_checks()
    return (kv, cmp, AllcloseCheck("idx_kv_cache", atol=1, rtol=0, max_error_ratio=0.0),
            AllcloseCheck("idx_kv_scale", atol=1e-7, rtol=1 / 128, max_error_ratio=0.0),
            state, dataclasses.replace(state, output="inner_compress_state"), x)


def reference_checks() -> tuple[Check, ...]:
    """The reference's compare table (prefill_cp_csa.py __main__): HCA's (cmp_kv and both
    states at its run defaults) and the indexer pool's."""
    kv, cmp, state, x = hca.reference_checks()
    return (kv, cmp, AllcloseCheck("idx_kv_cache", atol=1, rtol=0, max_error_ratio=0.01),
            AllcloseCheck("idx_kv_scale", atol=1e-4, rtol=1 / 128, max_error_ratio=0.01),
            state, dataclasses.replace(state, output="inner_compress_state"), x)


def _project(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return swa.project(ctx, v, POSITIONS)


def part_segment(v: Values, part: int) -> tuple[int, int, int]:
    """(segment, start, length) of the rank's part."""
    segment = int(v["predecessor_segments"][part]) + 1
    return segment, int(v["segment_starts_t"][segment]), int(v["overlay_active_lengths"][part, :, 1].sum())


def part_states(ctx: RankContext, v: Values, part: int, first: int) -> dict[str, torch.Tensor]:
    """Both compressors' state rows fp32 [end − first, ·] of positions first … end − 1 of the
    part's segment: before the step from the state pools, of earlier segments projected from
    their hidden tails (a segment's tail holds its last 8 rows: the window is >= 8), the
    segment's own from its rows."""
    win = ctx.case.window
    starts = v["segment_starts_t"].long()
    segment, start, length = part_segment(v, part)
    prefix = int(starts[0])
    history = torch.arange(first, max(first, min(prefix, start)))
    earlier = torch.arange(max(first, prefix), start)
    seg = torch.searchsorted(starts, earlier, right=True) - 1
    tail_start = torch.maximum(starts[seg], starts[(seg + 1).clamp(max=starts.numel() - 1)] - win)
    hidden = v["logical_hidden_tails"][seg, earlier - tail_start]
    own = v["x_normed"].reshape(tables.LOCAL_PARTS, MAX_SEGMENT_TILES * win, -1)[part, :length]
    positions = torch.cat((earlier, torch.arange(start, start + length)))
    out = {}
    for pool, table, which, _ in STATE_POOLS:
        held = v[pool].view(-1, v[pool].shape[-1])[csa_tables.state_rows(v[table], history)]
        out[which] = torch.cat((held, csa_math.states(torch.cat((hidden, own)), positions, v, which)))
    return out


def _compressor(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The payloads of the compact exchange (`COMPACT`): the rank's compressed rows (the part's
    at rows part·64 …), and on the final segment's owner its last <= 8 state rows."""
    m = ctx.model
    out = {"main_payload": torch.zeros(PAYLOAD_ROWS, m.head_dim, dtype=torch.bfloat16),
           "idx_payload": torch.zeros(PAYLOAD_ROWS, m.index_head_dim, dtype=torch.int8),
           "idx_scale_payload": torch.zeros(PAYLOAD_ROWS, 1),
           "record_meta": torch.full((PAYLOAD_ROWS, csa_tables.META_DIM), -1, dtype=torch.int32),
           "main_state_payload": torch.zeros(csa_tables.STATE_LEN, 4 * m.head_dim),
           "inner_state_payload": torch.zeros(csa_tables.STATE_LEN, 4 * m.index_head_dim),
           "state_meta": torch.zeros(csa_tables.META_DIM, dtype=torch.int32)}
    prefix = int(v["segment_starts_t"][0])
    for part in range(tables.LOCAL_PARTS):
        segment, start, length = part_segment(v, part)
        end, final = start + length, segment == int(v["final_segment_t"][0])
        state_first = max(prefix, end - csa_tables.STATE_LEN)
        first = min(csa_tables.state_first(start), state_first) if final else csa_tables.state_first(start)
        states = part_states(ctx, v, part, first)
        ends = csa_tables.boundaries(start, end)
        at = slice(part * csa_tables.ROWS_PER_SEGMENT, part * csa_tables.ROWS_PER_SEGMENT + len(ends))
        rows = csa_math.compress(m, v, states[csa_math.MAIN], states[csa_math.INNER], first, ends)
        out["main_payload"][at], out["idx_payload"][at], out["idx_scale_payload"][at] = rows
        out["record_meta"][at, 0] = torch.tensor([(b + 1) // csa_tables.COMPRESS_RATIO - 1 for b in ends],
                                                 dtype=torch.int32)
        out["record_meta"][at, 1] = torch.tensor(ends, dtype=torch.int32)
        if final:
            n = end - state_first
            for _, _, which, name in STATE_POOLS:
                out[name][:n] = states[which][state_first - first: end - first]
            out["state_meta"][0], out["state_meta"][1] = n, state_first
    return out


def commit_compact(v: Values, main: torch.Tensor, idx: torch.Tensor, idx_scale: torch.Tensor, meta: torch.Tensor,
                   main_state: torch.Tensor, inner_state: torch.Tensor,
                   state_meta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every rank's payloads (stacked [P, ...]) written into this rank's five pools through
    its own tables."""
    slots = meta[..., 0].reshape(-1).long()
    keep = slots >= 0
    cmp_kv, idx_kv, idx_sc = v["cmp_kv"], v["idx_kv_cache"], v["idx_kv_scale"]
    cmp_kv.view(-1, cmp_kv.shape[-1])[csa_tables.cmp_rows(v["cmp_block_table"], slots[keep])] = \
        main.reshape(-1, cmp_kv.shape[-1])[keep]
    rows = csa_tables.cmp_rows(v["idx_block_table"], slots[keep])
    idx_kv.view(-1, idx_kv.shape[-1])[rows] = idx.reshape(-1, idx_kv.shape[-1])[keep]
    idx_sc.view(-1, 1)[rows] = idx_scale.reshape(-1, 1)[keep]
    for (pool, table, _, _), payload in zip(STATE_POOLS, (main_state, inner_state)):
        for sent, (n, first) in zip(payload, state_meta[:, :2].tolist()):
            at = csa_tables.state_rows(v[table], torch.arange(first, first + n))
            v[pool].view(-1, v[pool].shape[-1])[at] = sent[:n]
    return {n: v[n] for n in csa_fixture.POOLS}


TABLES = ("cmp_block_table", "idx_block_table", "compress_state_block_table", "inner_compress_state_block_table")


def _compact_exchange(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    every = [wire.all_gather(v[n].contiguous(), ctx.group, ctx.tp) for n in COMPACT]
    return commit_compact(v, *every)


def _compact_exchange_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    own = {n: v[n][ctx.rank] for n in (*csa_fixture.POOLS, *TABLES)}
    return commit_compact({**v, **own}, *(v[n] for n in COMPACT))


def _active(ctx: RankContext, v: Values) -> torch.Tensor:
    return swa.row_mask(v["overlay_active_lengths"], ctx.case.window)


def _indexer_query(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    q, q_scale, weights = csa_math.query(ctx.model, v, v["qr"], v["qr_scale"], v["x_normed"],
                                         v[POSITIONS].reshape(-1))
    return {"q_idx": q, "q_idx_scale": q_scale, "idx_weights": weights}


def _indexer_topk(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """cmp_indices [rows, K]: each active row's top logical slots among the committed rows it sees."""
    seen = csa_math.visible(v[POSITIONS].reshape(-1), _active(ctx, v))
    rows = csa_tables.cmp_rows(v["idx_block_table"], torch.arange(int(seen.max())))
    idx = v["idx_kv_cache"].view(-1, ctx.model.index_head_dim)[rows]
    scale = v["idx_kv_scale"].view(-1)[rows]
    return {"cmp_indices": csa_math.select(ctx.model, v["q_idx"], v["q_idx_scale"], v["idx_weights"], idx, scale,
                                           seen)}


def _window_attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    m = ctx.model
    hd = v["kv"].shape[-1]
    staged = torch.cat((v["kv_cache"].reshape(-1, hd), v["logical_tails_out"].reshape(-1, hd), v["kv"]))
    win_keys, win_valid = attention.gather_rows(staged, v["swa_key_rows"].reshape(-1, m.sliding_window))
    cmp_keys, cmp_valid = attention.gather_rows(v["cmp_kv"], csa_tables.cmp_rows(v["cmp_block_table"],
                                                                                 v["cmp_indices"]))
    keys, valid = torch.cat((win_keys, cmp_keys), dim=1), torch.cat((win_valid, cmp_valid), dim=1)
    return {"o": attention.sparse_attention(v["q"], keys, valid, v["attn_sink"], m.softmax_scale)}


def stages() -> tuple[Stage, ...]:
    checks = {c.output: c for c in default_checks()}
    hca_stages = {s.name: s for s in hca.stages()}
    swa_stages = {s.name: s for s in swa.stages()}
    return (
        Stage("project", ("x_hc", *swa.FRONT, "freqs_cos", "freqs_sin", POSITIONS),
              (judged(bf16_close("q")), judged(bf16_close("kv")), judged(bf16_close("x_normed")),
               judged(exact("qr")), judged(fp32_close("qr_scale")), judged(fp32_close("post")),
               judged(fp32_close("comb")), judged(exact("rope_cos")), judged(exact("rope_sin"))), _project),
        # HCA's: the window's key table, both tails cut and exchanged.
        *(hca_stages[n] for n in ("key_table", "local_tails", "tail_exchange")),
        Stage("compressor", ("x_normed", "logical_hidden_tails", *csa_fixture.COMPRESSOR_WEIGHTS, "hadamard_idx",
                             "freqs_cos", "freqs_sin", "predecessor_segments", "segment_starts_t",
                             "overlay_active_lengths", "final_segment_t", "compress_state", "inner_compress_state",
                             "compress_state_block_table", "inner_compress_state_block_table"),
              (judged(bf16_close("main_payload")), judged(AllcloseCheck("idx_payload", atol=1, rtol=0)),
               judged(fp32_close("idx_scale_payload")), judged(exact("record_meta")),
               judged(fp32_close("main_state_payload")), judged(fp32_close("inner_state_payload")),
               judged(exact("state_meta"))), _compressor),
        Stage("compact_exchange", (*COMPACT, *csa_fixture.POOLS, *TABLES),
              tuple(judged(exact(n), checks[n]) for n in csa_fixture.POOLS),
              _compact_exchange, reference=_compact_exchange_reference,
              every_rank=(*COMPACT, *csa_fixture.POOLS, *TABLES)),
        Stage("indexer_query", ("qr", "qr_scale", "x_normed", POSITIONS, "freqs_cos", "freqs_sin",
                                *csa_fixture.INDEXER_WEIGHTS),
              (judged(AllcloseCheck("q_idx", atol=1, rtol=0)), judged(fp32_close("q_idx_scale")),
               judged(fp32_close("idx_weights"))), _indexer_query),
        Stage("indexer_topk", ("q_idx", "q_idx_scale", "idx_weights", "idx_kv_cache", "idx_kv_scale",
                               "idx_block_table", POSITIONS, "overlay_active_lengths"),
              (judged(exact("cmp_indices")),), _indexer_topk),
        Stage("window_attention", ("q", "kv", "logical_tails_out", "kv_cache", "swa_key_rows", "cmp_kv",
                                   "cmp_block_table", "cmp_indices", "attn_sink"),
              (judged(AllcloseCheck("o", atol=1e-4, rtol=1 / 128)),), _window_attention),
        # The SWA list's own (their checks are the same kv_cache and x_out defaults).
        *(swa_stages[n] for n in ("o_proj", "hc_post", "final_window_commit")),
    )  # fmt: skip


__all__ = ["POSITIONS", "PAYLOAD_ROWS", "COMPACT", "STATE_POOLS", "TABLES", "default_checks", "reference_checks",
           "part_segment", "part_states", "commit_compact", "stages"]
