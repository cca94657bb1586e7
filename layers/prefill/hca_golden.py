"""The independent HCA golden: HCA prefill on one device over the whole prompt (docs/prefill.md §5).

Built from positions alone, never from the CP tables the stage list reads. The SWA golden's
projection and window keys, plus the ratio-128 compressor over the prompt: every position's
(kv, score + APE) from its normed hidden row; each position b that completes a block (b + 1 ≡ 0
mod 128) pools positions b−127 … b (positions before the step from the compressor history of
the pool), RMSNorm, RoPE at b−127, one bf16 row at logical slot (b + 1)/128 − 1. Each query at
q attends to its window and to the first min(top-k, (q + 1)//128) compressed rows (history
rows, then the step's). Afterwards every rank's pools, each through the rank's own tables: the
step's compressed rows in cmp_kv, the state of the step's last ≤ 128 positions in
compress_state, the final raw window in kv_cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..components import hca_compressor as comp
from ..components.numerics import bf16, f32
from . import golden as swa_golden
from . import hca_tables
from .case import PrefillCase


def compressor_states(case: PrefillCase, w: Mapping[str, torch.Tensor], normed: torch.Tensor,
                      history: torch.Tensor) -> torch.Tensor:
    """(kv, score + APE) fp32 [n + total, 2·HD] of positions prefix − n … end − 1: `history`
    [n, 2·HD] then the step's rows from normed [total, D]."""
    positions = torch.arange(case.prefix, case.prefix + case.total)
    kv, score = comp.project(normed, w["cmp_wkv"], w["cmp_wgate"], w["cmp_ape"], positions)
    return torch.cat((history, torch.cat((kv, score), dim=-1)))


def compress(case: PrefillCase, w: Mapping[str, torch.Tensor], states: torch.Tensor,
             first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's compressed rows `(rows bf16 [n, HD], slots int64 [n])` from `states`, the
    rows of positions first … (one per position)."""
    ends = torch.tensor(hca_tables.boundaries(case.prefix, case.prefix + case.total), dtype=torch.int64)
    hd = case.model.head_dim
    if not ends.numel():
        return torch.zeros(0, hd, dtype=torch.bfloat16), ends
    offsets = ends[:, None] - comp.COMPRESS_RATIO + 1 - first + torch.arange(comp.COMPRESS_RATIO)
    pooled = torch.stack([comp.pool_window(states, rows) for rows in offsets])
    y = comp.normalize_pooled(pooled, w["cmp_norm_w"], case.model.rms_norm_eps)
    block = ends - comp.COMPRESS_RATIO + 1
    half = case.model.qk_rope_head_dim // 2
    y = comp.rope_compressed(y, f32(w["freqs_cos"][block, :half]), f32(w["freqs_sin"][block, :half]), case.model)
    return bf16(y), (ends + 1) // comp.COMPRESS_RATIO - 1


def compressed_keys(case: PrefillCase, history: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step token's compressed keys `(keys [total, Kc, HD], valid [total, Kc])`: logical
    rows 0 … min(top-k, (q+1)//128) − 1 of history [prefix//128, HD] then the step's rows."""
    logical = torch.cat((history, rows))
    positions = torch.arange(case.prefix, case.prefix + case.total)
    visible = ((positions + 1) // comp.COMPRESS_RATIO).clamp(max=case.model.index_topk)
    kc = int(visible.max()) if visible.numel() else 0
    valid = torch.arange(kc)[None, :] < visible[:, None]
    keys = torch.where(valid[..., None], logical[:kc][None], torch.zeros((), dtype=logical.dtype))
    return keys, valid


def golden(case: PrefillCase, ranks: Sequence[Mapping[str, torch.Tensor]],
           prompt: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The expected outputs of each rank whose tensors `ranks` holds (its pools and tables,
    weights replicated), from the whole prompt [total, HC, D]. The history is read through
    the first one's tables (every rank holds the same logical history)."""
    w, m, sb = ranks[0], case.model, hca_tables.state_block_size(case)
    hd = m.head_dim
    positions = torch.arange(case.prefix, case.prefix + case.total)
    front = swa_golden.project(m, w, prompt, positions)
    first = case.prefix - min(case.prefix, comp.COMPRESS_RATIO)
    history_rows = hca_tables.state_rows(w["compress_state_block_table"], torch.arange(first, case.prefix), sb)
    states = compressor_states(case, w, front["normed"], w["compress_state"].view(-1, 2 * hd)[history_rows])
    rows, slots = compress(case, w, states, first)
    history_slots = torch.arange(case.prefix // comp.COMPRESS_RATIO)
    history_cmp = w["cmp_kv"].view(-1, hd)[hca_tables.cmp_rows(w["cmp_block_table"], history_slots)]
    cmp_keys, cmp_valid = compressed_keys(case, history_cmp, rows)
    win_keys, win_valid = swa_golden.window_keys(case, front["kv"], w["kv_cache"])
    keys, valid = torch.cat((win_keys, cmp_keys), dim=1), torch.cat((win_valid, cmp_valid), dim=1)
    x_out = swa_golden.attend_and_project(m, w, prompt, front, keys, valid)
    kv_cache = swa_golden.final_window(case, front["kv"], w["kv_cache"])
    state_first, state_count = hca_tables.final_state_positions(case)
    final_states = states[state_first - first: state_first - first + state_count]
    outs = []
    for t in ranks:
        cmp_kv, state = t["cmp_kv"].clone(), t["compress_state"].clone()
        cmp_kv.view(-1, hd)[hca_tables.cmp_rows(t["cmp_block_table"], slots)] = rows
        state_at = hca_tables.state_rows(t["compress_state_block_table"],
                                         torch.arange(state_first, state_first + state_count), sb)
        state.view(-1, 2 * hd)[state_at] = final_states
        outs.append({"x_out": x_out, "kv_cache": kv_cache, "cmp_kv": cmp_kv, "compress_state": state})
    return outs


__all__ = ["compressor_states", "compress", "compressed_keys", "golden"]
