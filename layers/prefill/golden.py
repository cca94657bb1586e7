"""The independent golden: SWA prefill on one device over the whole prompt (docs/prefill.md §4).

Built from positions alone, never from the CP tables the implementation reads: every token
at global position q attends to the keys at positions max(0, q−WIN+1) … q, history keys
(< prefix) from the cache ring and the rest from the step's own projected KV. The result is
then cut into each rank's slice (`rank_slice`) and the final cache (the last WIN rows written
at their ring rows; history elsewhere untouched) is the same on every rank.
"""

from __future__ import annotations

import torch

from ..components import attention, hc, o_proj, qkv
from ..contract.config import ModelConfig
from . import tables
from .case import MAX_SEGMENT_TILES, PrefillCase


def project(model: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor) -> dict:
    """hc_pre, RMSNorm and Q/KV + RoPE of tokens x [N, HC, D] at global `positions` [N]."""
    x_mixed, post, comb = hc.hc_pre(x, w["hc_attn_fn"], w["hc_attn_scale"], w["hc_attn_base"], model)
    normed = qkv.rms_norm(x_mixed, w["attn_norm_w"], model.rms_norm_eps)
    cos, sin = w["freqs_cos"][positions.long()], w["freqs_sin"][positions.long()]
    q, kv, qr, qr_scale = qkv.qkv_proj_rope(normed, w["wq_a"], w["wq_b"], w["wq_b_scale"], w["wkv"], cos, sin,
                                            w["gamma_cq"], w["gamma_ckv"], model)
    return {"q": q, "kv": kv, "normed": normed, "qr": qr, "qr_scale": qr_scale, "post": post, "comb": comb,
            "cos": cos, "sin": sin}


def attend_and_project(model: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, front: dict,
                       keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Window attention of front["q"] over keys [N, WIN, HD] (valid [N, WIN]), the O projection
    with the full weights and hc_post: x_out fp32 [N, HC, D]."""
    o = attention.sparse_attention(front["q"], keys, valid, w["attn_sink"], model.softmax_scale)
    grouped = attention.pack_heads(o, front["cos"], front["sin"], model)
    attn_out = o_proj.grouped_o_proj(grouped, w["wo_a"], w["wo_b"], w["wo_b_scale"])
    return hc.hc_post(attn_out, x, front["post"], front["comb"])


def window_keys(case: PrefillCase, kv: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step token's window keys `(keys [total, WIN, HD], valid [total, WIN])`: positions
    max(0, q−WIN+1) … q, history (< prefix) from the cache ring, the rest from the step's kv."""
    win = case.window
    positions = torch.arange(case.prefix, case.prefix + case.total)
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    key_pos = positions[:, None] - win + 1 + torch.arange(win)[None, :]  # [N, WIN]
    valid = key_pos >= 0
    in_step = key_pos >= case.prefix
    keys = torch.zeros(case.total, win, flat.shape[-1], dtype=flat.dtype)
    keys[in_step] = kv[(key_pos - case.prefix)[in_step]]
    history = valid & ~in_step
    keys[history] = flat[key_pos[history] % case.cache_rows]
    return keys, valid


def final_window(case: PrefillCase, kv: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache after the step: the last WIN positions' kv at their ring rows, history elsewhere."""
    positions = torch.arange(case.prefix, case.prefix + case.total)
    final = kv_cache.clone()
    last = positions[-case.window:]
    final.view(-1, final.shape[-1])[last % case.cache_rows] = kv[-case.window:][last >= case.prefix]
    return final


def whole_prompt(case: PrefillCase, w: dict[str, torch.Tensor], prompt: torch.Tensor,
                 kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The single-device step over prompt [total, HC, D] (positions prefix …) with the initial
    kv_cache [blocks, rows, 1, HD]: `(x_out [total, HC, D], kv [total, HD], final kv_cache)`."""
    positions = torch.arange(case.prefix, case.prefix + case.total)
    front = project(case.model, w, prompt, positions)
    keys, valid = window_keys(case, front["kv"], kv_cache)
    x_out = attend_and_project(case.model, w, prompt, front, keys, valid)
    return x_out, front["kv"], final_window(case, front["kv"], kv_cache)


def rank_slice(case: PrefillCase, rank: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows [total, ...] of the whole prompt laid out as rank's `[2, tiles, WIN, ...]` (zeros
    where a tile is inactive), the reference's `x_hc` / `x_out` layout."""
    win, parts = case.window, tables.owner_segments(case)
    out = torch.zeros(tables.LOCAL_PARTS, MAX_SEGMENT_TILES, win, *rows.shape[1:], dtype=rows.dtype)
    for p in range(tables.LOCAL_PARTS):
        s = parts[rank][p]
        off = case.starts[s] - case.prefix
        for t in range(MAX_SEGMENT_TILES):
            n = tables.active_rows(case.lengths[s], win, t)
            out[p, t, :n] = rows[off + t * win: off + t * win + n]
    return out


def prompt_of(case: PrefillCase, x_hc: torch.Tensor) -> torch.Tensor:
    """The whole prompt [total, HC, D] back from every rank's x_hc [cp, 2, tiles, WIN, HC, D]."""
    win, parts = case.window, tables.owner_segments(case)
    prompt = torch.empty(case.total, *x_hc.shape[-2:], dtype=x_hc.dtype)
    for r in range(case.cp):
        for p in range(tables.LOCAL_PARTS):
            s = parts[r][p]
            off = case.starts[s] - case.prefix
            for t in range(MAX_SEGMENT_TILES):
                n = tables.active_rows(case.lengths[s], win, t)
                prompt[off + t * win: off + t * win + n] = x_hc[r, p, t, :n]
    return prompt


__all__ = ["project", "attend_and_project", "window_keys", "final_window", "whole_prompt", "rank_slice", "prompt_of"]
