"""The HCA CP prefill step as its stage list (docs/prefill.md §5; prefill_cp_hca.py), zigzag.

The SWA prefill's list with the ratio-128 compressor in it. Per rank: project its two segments
(Q/KV at global positions, and the normed hidden rows the compressor reads), cut the tails of
both the projected KV and the normed hidden rows, exchange both with every peer, then compress:
each block that ends in one of the rank's segments pools the 128 positions before its end,
taking the positions of earlier segments from their exchanged hidden tails (a window
straddles ranks whenever a segment does not start on a multiple of 128) and those before the
step from the state pool. The compact exchange sends every rank's compressed rows (with their
logical slots) and the final segment's last ≤ 128 compressor-state rows (from its owner) to
every peer; each rank commits them through its own block tables. Attention reads the window
and the compressed rows 0 … min(top-k, (q+1)//128) − 1; then the SWA list's O projection,
hc_post and final-window commit.
"""

from __future__ import annotations

import torch

from ..components import attention
from ..components import hca_compressor as comp
from ..components.numerics import bf16, f32
from ..contract.checks import HIDDEN_AXES, AllcloseCheck, Check, RelDiffCheck
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import bf16_close, exact, fp32_close, judged
from ..distributed import wire
from . import exchange, hca_tables, swa, tables
from .case import MAX_SEGMENT_TILES

POSITIONS = "query_positions"  # the HCA reference's name for the rank's query position table
COMPRESSOR_WEIGHTS = ("cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w")
CMP_ROWS = tables.LOCAL_PARTS * hca_tables.CMP_ROWS_PER_SEGMENT  # compressed rows a rank sends


def default_checks() -> tuple[Check, ...]:
    """kv_cache, cmp_kv, compress_state, x_out: stricter than the reference where the golden allows."""
    return (AllcloseCheck("kv_cache", atol=1e-4, rtol=1 / 128, max_error_ratio=0.0),
            AllcloseCheck("cmp_kv", atol=1e-4, rtol=1 / 128, max_error_ratio=0.0),
            AllcloseCheck("compress_state", atol=1e-5, rtol=1e-4, max_error_ratio=0.0),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.005, max_diff_hd=1, axes=HIDDEN_AXES))


def reference_checks() -> tuple[Check, ...]:
    """The reference's compare table (prefill_cp_hca.py __main__; cmp_kv and compress_state at
    its run defaults)."""
    return (AllcloseCheck("kv_cache", atol=1e-4, rtol=1 / 128),
            AllcloseCheck("cmp_kv", atol=1e-2, rtol=1e-2),
            AllcloseCheck("compress_state", atol=1e-2, rtol=1e-2),
            RelDiffCheck("x_out", diff_thd=5e-3, pct_thd=0.005, max_diff_hd=1, axes=HIDDEN_AXES))


def _project(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return swa.project(ctx, v, POSITIONS)


def _key_table(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return swa.key_table(ctx, v, POSITIONS)


def _local_tails(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """local_kv_tail and local_hidden_tail [2·WIN, ·]: each part's last ≤ WIN rows."""
    win, lengths = ctx.case.window, v["overlay_active_lengths"]
    return {"local_kv_tail": swa.part_tails(v["kv"], lengths, win),
            "local_hidden_tail": swa.part_tails(v["x_normed"], lengths, win)}


def _tail_exchange(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    index = v["reverse_index"]
    return {"logical_tails_out": exchange.tail_exchange(v["local_kv_tail"], index, ctx.group, ctx.tp),
            "logical_hidden_tails": exchange.tail_exchange(v["local_hidden_tail"], index, ctx.group, ctx.tp)}


def _tail_exchange_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    index = v["reverse_index"][0]
    return {"logical_tails_out": exchange.to_logical(v["local_kv_tail"], index),
            "logical_hidden_tails": exchange.to_logical(v["local_hidden_tail"], index)}


def part_states(ctx: RankContext, v: Values, part: int) -> tuple[torch.Tensor, int]:
    """(kv, score + APE) fp32 [n, 2·HD] of the positions first … end − 1 around the part's
    segment (first = 128 before its start): the state pool before the step, the hidden tails
    of the earlier segments, the segment's own rows; `(states, first)`. A position none of them
    holds stays (0, 0), as in the reference's scratch pool."""
    win, hd, sb = ctx.case.window, ctx.model.head_dim, ctx.model.c128_state_block_size
    starts = v["segment_starts_t"].long()
    segment = int(v["predecessor_segments"][part]) + 1
    start, length = int(starts[segment]), int(v["overlay_active_lengths"][part, :, 1].sum())
    first, prefix = max(0, start - comp.COMPRESS_RATIO), int(starts[0])
    states = torch.zeros(start + length - first, 2 * hd)
    history = torch.arange(first, max(first, min(prefix, start)))
    rows = hca_tables.state_rows(v["compress_state_block_table"], history, sb)
    states[history - first] = v["compress_state"].view(-1, 2 * hd)[rows]
    tail_pos = v["segment_tail_positions"][:segment].reshape(-1).long()
    hidden = v["logical_hidden_tails"][:segment].flatten(0, 1)
    keep = (tail_pos >= first) & (tail_pos < start)
    own_pos = torch.arange(start, start + length)
    own = v["x_normed"].reshape(tables.LOCAL_PARTS, MAX_SEGMENT_TILES * win, -1)[part, :length]
    pos = torch.cat((tail_pos[keep], own_pos))
    kv, score = comp.project(torch.cat((hidden[keep], own)), v["cmp_wkv"], v["cmp_wgate"], v["cmp_ape"], pos)
    states[pos - first] = torch.cat((kv, score), dim=-1)
    return states, first


def compress_part(ctx: RankContext, v: Values, states: torch.Tensor, first: int,
                  ends: list[int]) -> torch.Tensor:
    """The compressed rows bf16 [len(ends), HD] of the blocks ending at `ends`."""
    m = ctx.model
    ends_t = torch.tensor(ends, dtype=torch.int64)
    offsets = ends_t[:, None] - comp.COMPRESS_RATIO + 1 - first + torch.arange(comp.COMPRESS_RATIO)
    pooled = torch.stack([comp.pool_window(states, rows) for rows in offsets])
    y = comp.normalize_pooled(pooled, v["cmp_norm_w"], m.rms_norm_eps)
    block, half = ends_t - comp.COMPRESS_RATIO + 1, m.qk_rope_head_dim // 2
    return bf16(comp.rope_compressed(y, f32(v["freqs_cos"][block, :half]), f32(v["freqs_sin"][block, :half]), m))


def _compressor(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """local_cmp_payload [4, HD] with local_cmp_meta [4, 8] (col 0: logical slot, −1 none; col 1:
    the block's end), and, on the final segment's owner, local_state_payload [WIN, 2·HD] with
    local_state_meta [8] (col 0: rows, col 1: first position)."""
    win, hd = ctx.case.window, ctx.model.head_dim
    payload = torch.zeros(CMP_ROWS, hd, dtype=torch.bfloat16)
    meta = torch.full((CMP_ROWS, hca_tables.META_DIM), -1, dtype=torch.int32)
    state_payload = torch.zeros(win, 2 * hd)
    state_meta = torch.zeros(hca_tables.META_DIM, dtype=torch.int32)
    for part in range(tables.LOCAL_PARTS):
        states, first = part_states(ctx, v, part)
        segment = int(v["predecessor_segments"][part]) + 1
        start = int(v["segment_starts_t"][segment])
        ends = hca_tables.boundaries(start, first + states.shape[0])
        at = part * hca_tables.CMP_ROWS_PER_SEGMENT
        if ends:
            payload[at: at + len(ends)] = compress_part(ctx, v, states, first, ends)
            meta[at: at + len(ends), 0] = torch.tensor([(b + 1) // comp.COMPRESS_RATIO - 1 for b in ends])
            meta[at: at + len(ends), 1] = torch.tensor(ends)
        if segment == int(v["final_segment_t"][0]):
            n = int(v["snapshot_valid"][part])
            snap = v["snapshot_positions"][part, :n].long()
            state_payload[:n] = states[snap - first]
            state_meta[0], state_meta[1] = n, int(snap[0]) if n else 0
    return {"local_cmp_payload": payload, "local_cmp_meta": meta, "local_state_payload": state_payload,
            "local_state_meta": state_meta}


def commit_compact(v: Values, payload: torch.Tensor, meta: torch.Tensor, state_payload: torch.Tensor,
                   state_meta: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """Every rank's compressed rows and the final state rows (stacked [P, ...]) written into this
    rank's cmp_kv and compress_state through its own tables."""
    cmp_kv, state = v["cmp_kv"], v["compress_state"]
    hd = cmp_kv.shape[-1]
    slots = meta[..., 0].reshape(-1).long()
    keep = slots >= 0
    cmp_kv.view(-1, hd)[hca_tables.cmp_rows(v["cmp_block_table"], slots[keep])] = payload.reshape(-1, hd)[keep]
    for rows, (n, first) in zip(state_payload, state_meta[:, :2].tolist()):
        at = hca_tables.state_rows(v["compress_state_block_table"], torch.arange(first, first + n), block_size)
        state.view(-1, 2 * hd)[at] = rows[:n]
    return {"cmp_kv": cmp_kv, "compress_state": state}


def _compact_exchange(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    every = [wire.all_gather(v[n].contiguous(), ctx.group, ctx.tp) for n in COMPACT]
    return commit_compact(v, *every, ctx.model.c128_state_block_size)


def _compact_exchange_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    own = {n: v[n][ctx.rank] for n in ("cmp_kv", "compress_state", "cmp_block_table", "compress_state_block_table")}
    return commit_compact({**v, **own}, *(v[n] for n in COMPACT), ctx.model.c128_state_block_size)


COMPACT = ("local_cmp_payload", "local_cmp_meta", "local_state_payload", "local_state_meta")


def compressed_key_rows(positions: torch.Tensor, active: torch.Tensor, cmp_block_table: torch.Tensor,
                        topk: int) -> torch.Tensor:
    """Flat cmp_kv rows [N, Kc] of each query's compressed keys: logical rows 0 …
    min(top-k, (q+1)//128) − 1 through the table, −1 past them and for inactive rows."""
    visible = torch.where(active, (positions.long() + 1) // comp.COMPRESS_RATIO, 0).clamp(max=topk)
    kc = max(1, int(visible.max()))
    slots = torch.arange(kc).expand(positions.numel(), kc)
    return torch.where(slots < visible[:, None], hca_tables.cmp_rows(cmp_block_table, slots), -1)


def attend(ctx: RankContext, v: Values, staged: torch.Tensor) -> dict[str, torch.Tensor]:
    """`o`: each query over its window keys (`swa_key_rows` into the layout's `staged` rows)
    then its visible compressed rows, one joint softmax with the sink."""
    m = ctx.model
    win_keys, win_valid = attention.gather_rows(staged, v["swa_key_rows"].reshape(-1, m.sliding_window))
    active = swa.row_mask(v["overlay_active_lengths"], ctx.case.window)
    rows = compressed_key_rows(v[POSITIONS].reshape(-1), active, v["cmp_block_table"], m.index_topk)
    cmp_keys, cmp_valid = attention.gather_rows(v["cmp_kv"], rows)
    keys, valid = torch.cat((win_keys, cmp_keys), dim=1), torch.cat((win_valid, cmp_valid), dim=1)
    return {"o": attention.sparse_attention(v["q"], keys, valid, v["attn_sink"], m.softmax_scale)}


def _window_attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    hd = v["kv"].shape[-1]
    return attend(ctx, v, torch.cat((v["kv_cache"].reshape(-1, hd), v["logical_tails_out"].reshape(-1, hd), v["kv"])))


def stages() -> tuple[Stage, ...]:
    _, cmp_check, state_check, _ = default_checks()
    swa_stages = {s.name: s for s in swa.stages()}
    return (
        Stage("project", ("x_hc", *swa.FRONT, "freqs_cos", "freqs_sin", POSITIONS),
              (judged(bf16_close("q")), judged(bf16_close("kv")), judged(bf16_close("x_normed")),
               judged(fp32_close("post")), judged(fp32_close("comb")), judged(exact("rope_cos")),
               judged(exact("rope_sin"))), _project),
        Stage("key_table", (POSITIONS, "overlay_active_lengths", "predecessor_segments", "segment_starts_t",
                            "kv_cache"), (judged(exact("swa_key_rows")),), _key_table),
        Stage("local_tails", ("kv", "x_normed", "overlay_active_lengths"),
              (judged(exact("local_kv_tail"), bf16_close("local_kv_tail")),
               judged(exact("local_hidden_tail"), bf16_close("local_hidden_tail"))), _local_tails),
        Stage("tail_exchange", ("local_kv_tail", "local_hidden_tail", "reverse_index"),
              (judged(exact("logical_tails_out"), bf16_close("logical_tails_out")),
               judged(exact("logical_hidden_tails"), bf16_close("logical_hidden_tails"))),
              _tail_exchange, reference=_tail_exchange_reference,
              every_rank=("local_kv_tail", "local_hidden_tail", "reverse_index")),
        Stage("compressor", ("x_normed", "logical_hidden_tails", *COMPRESSOR_WEIGHTS, "freqs_cos", "freqs_sin",
                             "predecessor_segments", "segment_starts_t", "overlay_active_lengths",
                             "segment_tail_positions", "snapshot_positions", "snapshot_valid", "final_segment_t",
                             "compress_state", "compress_state_block_table"),
              (judged(bf16_close("local_cmp_payload")), judged(exact("local_cmp_meta")),
               judged(fp32_close("local_state_payload")), judged(exact("local_state_meta"))), _compressor),
        Stage("compact_exchange", (*COMPACT, "cmp_kv", "compress_state", "cmp_block_table",
                                   "compress_state_block_table"),
              (judged(exact("cmp_kv"), cmp_check), judged(exact("compress_state"), state_check)),
              _compact_exchange, reference=_compact_exchange_reference,
              every_rank=(*COMPACT, "cmp_kv", "compress_state", "cmp_block_table", "compress_state_block_table")),
        Stage("window_attention", ("q", "kv", "logical_tails_out", "kv_cache", "swa_key_rows", "cmp_kv",
                                   "cmp_block_table", POSITIONS, "overlay_active_lengths", "attn_sink"),
              (judged(AllcloseCheck("o", atol=1e-4, rtol=1 / 128)),), _window_attention),
        # The SWA list's own (their checks are the same kv_cache and x_out defaults).
        *(swa_stages[n] for n in ("o_proj", "hc_post", "final_window_commit")),
    )  # fmt: skip


__all__ = ["POSITIONS", "COMPRESSOR_WEIGHTS", "CMP_ROWS", "COMPACT", "default_checks", "reference_checks",
           "part_states", "compress_part", "commit_compact", "compressed_key_rows", "attend", "stages"]
