"""The SWA CP prefill step as its stage list (docs/prefill.md §5; prefill_cp_swa.py).

Per rank: derive its key table from the reference's metadata, project its two segments (hc_pre, RMSNorm, Q/KV with RoPE at global positions),
cut each segment's tail, exchange the tails with every peer, attend over the window (history
from the cache ring, earlier segments from their tails, the segment itself from its own
rows), project out (W8A8, full weights: every rank holds every head), hc_post, and commit the
final window into the rank's own kv_cache. Rows are the rank's `[2, tiles, WIN]` layout
flattened (x_out [2·tiles·WIN, HC, D]); inactive rows are zero in x_out.
"""

from __future__ import annotations

import torch

from ..components import attention, hc, o_proj, qkv
from ..contract.checks import HIDDEN_AXES, AllcloseCheck, Check, RelDiffCheck
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import bf16_close, exact, fp32_close, judged
from . import exchange, tables
from .case import MAX_SEGMENT_TILES

FRONT = ("hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm_w", "wq_a", "wq_b", "wq_b_scale", "wkv",
         "gamma_cq", "gamma_ckv")


def default_checks() -> tuple[Check, ...]:
    """kv_cache then x_out; stricter than the reference profile where the golden allows."""
    return (AllcloseCheck("kv_cache", atol=1e-4, rtol=1 / 128, max_error_ratio=0.0),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.005, max_diff_hd=1, axes=HIDDEN_AXES))


def reference_checks() -> tuple[Check, ...]:
    """The reference's compare table (prefill_cp_swa.py __main__)."""
    return (AllcloseCheck("kv_cache", atol=1e-4, rtol=1e-2, max_error_ratio=0.005),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.005, max_diff_hd=1, axes=HIDDEN_AXES))


def row_mask(overlay_active_lengths: torch.Tensor, window: int) -> torch.Tensor:
    """bool [2·tiles·WIN]: which of the rank's rows hold a token (each tile's own active rows)."""
    return (torch.arange(window) < overlay_active_lengths[..., 1].long()[..., None]).reshape(-1)


def key_table(ctx: RankContext, v: Values, positions: str = "query_position_ids") -> dict[str, torch.Tensor]:
    """The key_table stage; `positions`: the name of the rank's query position table (HCA's
    reference calls it query_positions)."""
    rows = tables.key_rows(v[positions], v["overlay_active_lengths"], v["predecessor_segments"],
                           v["segment_starts_t"], ctx.case.window, v["kv_cache"][..., 0, 0].numel())
    return {"swa_key_rows": rows}


def project(ctx: RankContext, v: Values, positions: str = "query_position_ids") -> dict[str, torch.Tensor]:
    """The project stage; `positions` as in `key_table`. x_normed is what a compressor reads,
    qr / qr_scale (the int8 Q latent) what an indexer does."""
    m = ctx.model
    x = v["x_hc"].reshape(-1, m.hc_mult, m.hidden_size)
    x_mixed, post, comb = hc.hc_pre(x, v["hc_attn_fn"], v["hc_attn_scale"], v["hc_attn_base"], m)
    normed = qkv.rms_norm(x_mixed, v["attn_norm_w"], m.rms_norm_eps)
    pos = v[positions].reshape(-1).long()
    cos, sin = v["freqs_cos"][pos], v["freqs_sin"][pos]
    q, kv, qr, qr_scale = qkv.qkv_proj_rope(normed, v["wq_a"], v["wq_b"], v["wq_b_scale"], v["wkv"], cos, sin,
                                            v["gamma_cq"], v["gamma_ckv"], m)
    return {"q": q, "kv": kv, "x_normed": normed, "qr": qr, "qr_scale": qr_scale, "post": post, "comb": comb,
            "rope_cos": cos, "rope_sin": sin}


def part_tails(rows: torch.Tensor, overlay_active_lengths: torch.Tensor, win: int) -> torch.Tensor:
    """[2·WIN, C]: the last ≤ WIN of each part's rows (rows: the rank's layout rows [2·tiles·WIN,
    C]), zero-padded."""
    rows = rows.reshape(tables.LOCAL_PARTS, MAX_SEGMENT_TILES * win, -1)
    tail = torch.zeros(tables.LOCAL_PARTS, win, rows.shape[-1], dtype=rows.dtype)
    lengths = overlay_active_lengths[..., 1].sum(dim=1)  # each part's segment length
    for p in range(tables.LOCAL_PARTS):
        n = int(lengths[p])
        start = max(0, n - win)
        tail[p, : n - start] = rows[p, start:n]
    return tail.reshape(tables.LOCAL_PARTS * win, -1)


def _local_tails(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """local_kv_tail [2·WIN, HD]: the last ≤ WIN rows of each part's segment, zero-padded."""
    return {"local_kv_tail": part_tails(v["kv"], v["overlay_active_lengths"], ctx.case.window)}


def _tail_exchange(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"logical_tails_out": exchange.tail_exchange(v["local_kv_tail"], v["reverse_index"], ctx.group, ctx.tp)}


def _tail_exchange_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The same movement from every rank's local_kv_tail stacked [P, 2·WIN, HD]."""
    return {"logical_tails_out": exchange.to_logical(v["local_kv_tail"], v["reverse_index"][0])}


def _window_attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    m = ctx.model
    hd = v["kv"].shape[-1]
    staged = torch.cat((v["kv_cache"].reshape(-1, hd), v["logical_tails_out"].reshape(-1, hd), v["kv"]))
    rows = v["swa_key_rows"].reshape(-1, m.sliding_window)
    keys, valid = attention.gather_rows(staged, rows)
    return {"o": attention.sparse_attention(v["q"], keys, valid, v["attn_sink"], m.softmax_scale)}


def _o_proj(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    grouped = attention.pack_heads(v["o"], v["rope_cos"], v["rope_sin"], ctx.model)
    return {"attn_out": o_proj.grouped_o_proj(grouped, v["wo_a"], v["wo_b"], v["wo_b_scale"])}


def _hc_post(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    x = v["x_hc"]
    y = hc.hc_post(v["attn_out"], x.reshape(-1, *x.shape[-2:]), v["post"], v["comb"])
    y[~row_mask(v["overlay_active_lengths"], ctx.case.window)] = 0
    return {"x_out": y}  # [rows, HC, D]: the layout's rows in order (part, tile, row)


def _final_window(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """Every rank writes the final WIN rows (from the logical tails) at final_slot_mapping."""
    cache, tails = v["kv_cache"], v["logical_tails_out"]
    flat = cache.view(-1, cache.shape[-1])
    keep = v["final_win_seg_src"] >= 0
    seg, row = v["final_win_seg_src"][keep].long(), v["final_win_row_src"][keep].long()
    flat[v["final_slot_mapping"][keep].long()] = tails[seg, row]
    return {"kv_cache": cache}


def stages() -> tuple[Stage, ...]:
    kv_check, x_check = default_checks()
    return (
        Stage("project", ("x_hc", *FRONT, "freqs_cos", "freqs_sin", "query_position_ids"),
              (judged(bf16_close("q")), judged(bf16_close("kv")), judged(fp32_close("post")),
               judged(fp32_close("comb")), judged(exact("rope_cos")), judged(exact("rope_sin"))), project),
        Stage("key_table", ("query_position_ids", "overlay_active_lengths", "predecessor_segments",
                            "segment_starts_t", "kv_cache"), (judged(exact("swa_key_rows")),), key_table),
        Stage("local_tails", ("kv", "overlay_active_lengths"), (judged(exact("local_kv_tail"), bf16_close("local_kv_tail")),),
              _local_tails),
        Stage("tail_exchange", ("local_kv_tail", "reverse_index"),
              (judged(exact("logical_tails_out"), bf16_close("logical_tails_out")),),
              _tail_exchange, reference=_tail_exchange_reference, every_rank=("local_kv_tail", "reverse_index")),
        Stage("window_attention", ("q", "kv", "logical_tails_out", "kv_cache", "swa_key_rows", "attn_sink"),
              (judged(AllcloseCheck("o", atol=1e-4, rtol=1 / 128)),), _window_attention),
        Stage("o_proj", ("o", "rope_cos", "rope_sin", "wo_a", "wo_b", "wo_b_scale"),
              (judged(bf16_close("attn_out")),), _o_proj),
        Stage("hc_post", ("attn_out", "x_hc", "post", "comb", "overlay_active_lengths"),
              (judged(fp32_close("x_out"), x_check),), _hc_post),
        Stage("final_window_commit", ("kv_cache", "logical_tails_out", "final_win_seg_src", "final_win_row_src",
                                      "final_slot_mapping"), (judged(exact("kv_cache"), kv_check),), _final_window),
    )  # fmt: skip


__all__ = ["stages", "default_checks", "reference_checks", "row_mask"]
