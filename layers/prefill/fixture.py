"""Rank r's slice of a CP prefill case, drawn from one seeded prompt stream (docs/prefill.md §3).

Weights are the SWA decode layer's (its recipe, drawn at tp = 1) and
replicated. The prompt is drawn segment by segment (key: the logical segment), so a rank draws
only its two segments and both layouts see the same prompt. The history in the KV ring is
the same on every rank (the pool every rank commits the final window to).
"""

from __future__ import annotations

import torch

from ..components import rope
from ..contract.case import Case
from ..fixtures import draw
from ..swa import layer as swa_decode
from . import tables
from .case import MAX_SEGMENT_TILES, PREFILL_BLOCK_ROWS, PrefillCase

WEIGHTS = ("hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm_w", "wq_a", "wq_b", "wq_b_scale", "wkv",
           "gamma_cq", "gamma_ckv", "attn_sink", "wo_a", "wo_b", "wo_b_scale")


def weights(case: PrefillCase) -> dict[str, torch.Tensor]:
    """Every replicated weight, full O weights included, and the RoPE table [max_pos, R]."""
    m = case.model
    decode = Case("swa", m, 1, m.decode_seq, case.seed)
    held = swa_decode.LAYER.rank_inputs(decode, 0)
    cos, sin = rope.rope_rows(m, torch.arange(m.max_position_embeddings), 0)
    return {**{n: held[n] for n in WEIGHTS}, "freqs_cos": cos, "freqs_sin": sin}


def segment_tokens(case: PrefillCase, segment: int) -> torch.Tensor:
    """x_hc rows [len, HC, D] of one logical segment."""
    m = case.model
    return draw.uniform((case.lengths[segment], m.hc_mult, m.hidden_size), -1.0, 1.0, case.seed, "prefill_x", segment)


def history_cache(case: PrefillCase) -> torch.Tensor:
    """The KV ring before the step [blocks, rows, 1, HD], unit-RMS rows (the decode recipe)."""
    m = case.model
    return draw.normal((m.prefill_ori_block_num, PREFILL_BLOCK_ROWS, 1, m.head_dim), case.seed, "prefill_kv_cache",
                       dtype=torch.bfloat16, transform=draw.unit_rms_rows(m.rms_norm_eps))


def rank_tables(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """Rank's metadata with the reference's names: its own slice of the per-rank tables (no cp
    axis) and the replicated ones whole."""
    positions, _ = tables.query_positions(case)
    parts = tables.owner_segments(case)[rank]
    seg_src, row_src, slot = tables.final_window(case)
    gathered = {"gathered_slot_mapping": tables.gathered_slot_mapping(case)} if case.cp_layout == "contiguous" else {}
    return {
        "segment_starts_t": torch.tensor(case.starts, dtype=torch.int32),
        "predecessor_segments": torch.tensor([s - 1 for s in parts], dtype=torch.int32),
        "query_position_ids": positions[rank],
        "overlay_active_lengths": tables.overlay_active_lengths(case)[rank],
        "reverse_index": tables.reverse_index(case),
        "final_win_seg_src": seg_src,
        "final_win_row_src": row_src,
        "final_slot_mapping": slot,
        "owner_rank_table": tables.owner_rank_table(case),
        **gathered,
    }


def rank_inputs(case: PrefillCase, rank: int, w: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Rank's inputs: its x_hc [2, tiles, WIN, HC, D] (its two segments only), the history
    cache, the replicated weights and its tables."""
    m, win = case.model, case.window
    x = torch.zeros(tables.LOCAL_PARTS, MAX_SEGMENT_TILES, win, m.hc_mult, m.hidden_size)
    for p, s in enumerate(tables.owner_segments(case)[rank]):
        rows = segment_tokens(case, s)
        for t in range(MAX_SEGMENT_TILES):
            n = tables.active_rows(case.lengths[s], win, t)
            x[p, t, :n] = rows[t * win: t * win + n]
    return {"x_hc": x, "kv_cache": history_cache(case), **(w or weights(case)), **rank_tables(case, rank)}


def whole_prompt(case: PrefillCase) -> torch.Tensor:
    """The prompt [total, HC, D] in logical order (the golden's input)."""
    return torch.cat([segment_tokens(case, s) for s in range(case.num_segments)])


__all__ = ["WEIGHTS", "weights", "segment_tokens", "history_cache", "rank_tables", "rank_inputs", "whole_prompt"]
