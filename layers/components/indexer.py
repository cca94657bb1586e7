"""The CSA lightning indexer: int8 index cache commit, query, scores and top-k (csa.md §4.6, §4.7).

Owns the indexer side of one CSA decode step on one rank: the inner compressor's commit
(Hadamard rotation of the bf16 row, per-row int8 quantization into `idx_kv_cache` /
`idx_kv_scale`), the indexer query (int8 Q latent × idx_wq_b, RoPE at the request's first
position, Hadamard, per-(token, head) int8), the per-head weights, the exact int8 scores of
every visible compressed slot with their causal limits, and the top-k selection. The inner
compressor itself is `layers.csa_compressor`; attention over the selection is `layers.csa.layer`.

Top-k rule (§4.6, §10.7): descending score, ties broken by ascending slot (a stable sort),
the selected slots kept in that order — the order places each slot in its 128-key attention
tile. Entries past `min(K, visible)` are −1.

The stages are composed by `layers.csa.layer` (its forward looks them up at call time, so a test
can inject a defect into one stage, e.g. `select_topk` or `commit_idx_rows`).
"""

from __future__ import annotations

import torch

from . import rope
from ..contract.config import ModelConfig
from .numerics import bf16, f32, int8_matmul, int8_quant_per_row

COMPRESS_RATIO = 4
# fp32 elements of one chunk of the [requests, S·IH, slots] score product: bounds memory at
# FLASH dims (2050 slots of the 8k requests × 512 query rows per request); values do not
# depend on it, every request is scored independently.
_SCORE_CHUNK_ELEMENTS = 1 << 24


def hadamard_rotate(x: torch.Tensor, hadamard_idx: torch.Tensor) -> torch.Tensor:
    """`f32(bf16(x)) @ f32(hadamard)` over the last axis, fp32 (the row is bf16 before the rotation)."""
    return f32(bf16(x)) @ f32(hadamard_idx)


def commit_idx_rows(
    idx_kv_cache: torch.Tensor,
    idx_kv_scale: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    hadamard_idx: torch.Tensor,
) -> None:
    """Commit the inner compressor's rows [B, ID] fp32 where slot >= 0 (§4.7).

    The rotated row is rounded to bf16 and RNE-quantized per row: int8 values into
    idx_kv_cache, the dequant scale `1/(127/amax)` into idx_kv_scale.
    """
    keep = slots >= 0
    q, scale = int8_quant_per_row(bf16(hadamard_rotate(rows[keep], hadamard_idx)))
    idx_kv_cache.view(-1, idx_kv_cache.shape[-1])[slots[keep]] = q
    idx_kv_scale.view(-1, 1)[slots[keep]] = scale


def query(
    model: ModelConfig,
    qr: torch.Tensor,
    qr_scale: torch.Tensor,
    idx_wq_b: torch.Tensor,
    idx_wq_b_scale: torch.Tensor,
    step_cos: torch.Tensor,
    step_sin: torch.Tensor,
    hadamard_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries `(q int8 [T, IH, ID], q_scale fp32 [T, IH, 1])` (§4.6 steps 1–4).

    step_cos / step_sin [T, R] are the rows of each token's request's first position: every
    token and head of a request is rotated by the same angle (§9 pitfall 5).
    """
    t = qr.shape[0]
    ih, idd, inope = model.index_n_heads, model.index_head_dim, model.index_nope_head_dim
    qi = ((int8_matmul(qr, idx_wq_b) * f32(qr_scale)) * f32(idx_wq_b_scale)).reshape(t, ih, idd)
    qh = torch.cat((bf16(qi[..., :inope]), rope.apply_rope(qi[..., inope:], step_cos, step_sin)), dim=-1)
    return int8_quant_per_row(hadamard_rotate(qh, hadamard_idx))


def head_weights(model: ModelConfig, x_normed: torch.Tensor, weights_proj: torch.Tensor) -> torch.Tensor:
    """Per-head score weights `(x @ weights_proj) · ID^−½ · IH^−½`, fp32 [T, IH] (may be negative)."""
    return (f32(x_normed) @ f32(weights_proj)) * model.index_weights_scale


def cache_rows(idx_block_table: torch.Tensor, n_slots: int, block_size: int) -> torch.Tensor:
    """Physical idx-cache rows of slots 0..n_slots−1 of every request, int64 [B, n_slots].

    Every page a token can see is mapped: the CSA tables have ceil(L/4/32) pages or more
    and the fixture never leaves an entry negative.
    """
    u = torch.arange(n_slots, dtype=torch.int64, device=idx_block_table.device)
    return idx_block_table.to(torch.int64)[:, u // block_size] * block_size + u % block_size


def scores(
    model: ModelConfig,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    idx_kv_cache: torch.Tensor,
    idx_kv_scale: torch.Tensor,
    idx_block_table: torch.Tensor,
    n_slots: int,
) -> torch.Tensor:
    """Index scores of slots 0..n_slots−1 of each token's request, fp32 [T, n_slots] (§4.6 step 7).

    `score[t, u] = (Σ_h relu(f32(q_t,h · k_u) · q_scale_t,h) · w_t,h) · k_scale_u`: exact int8
    dots, fp32 head sum, the cache scale applied after the sum. Slots the caller does not
    let the token see are still scored here (their values are masked by `select_topk`).
    """
    t, ih, idd = q.shape
    seq = model.decode_seq
    b = t // seq
    rows = cache_rows(idx_block_table, n_slots, model.block_size)  # [B, U]
    k_flat = idx_kv_cache.reshape(-1, idd)
    s_flat = idx_kv_scale.reshape(-1)
    out = torch.empty(t, n_slots, dtype=torch.float32, device=q.device)
    qb = q.reshape(b, seq * ih, idd)
    chunk = max(1, _SCORE_CHUNK_ELEMENTS // max(1, seq * ih * n_slots))
    for b0 in range(0, b, chunk):
        r = rows[b0 : b0 + chunk]
        dots = int8_matmul(qb[b0 : b0 + chunk], k_flat[r].transpose(1, 2))  # [b, S·IH, U], exact
        tok = slice(b0 * seq, (b0 + r.shape[0]) * seq)
        # In place on the fresh product: the same values without three more [b, S, IH, U] tensors.
        sc = dots.view(-1, seq, ih, n_slots).mul_(f32(q_scale[tok]).reshape(-1, seq, ih, 1)).relu_()
        head_sum = sc.mul_(f32(weights[tok]).reshape(-1, seq, ih, 1)).sum(dim=2)  # [b, S, U]
        out[tok] = head_sum.mul_(f32(s_flat[r])[:, None, :]).reshape(-1, n_slots)
    return out


def visible_slots(model: ModelConfig, position_ids: torch.Tensor, kv_seq_lens: torch.Tensor) -> torch.Tensor:
    """Slots token t may select: `min(kv_seq_len div 4, (p+1) div 4, L/4)`, int64 [T].

    Slot u's boundary is position 4u+3, so it is causal for p iff u < (p+1) div 4; the second
    boundary of the step counts although it is never computed (§9 pitfall 1).
    """
    seq = model.decode_seq
    cache_len = (kv_seq_lens.to(torch.int64) // COMPRESS_RATIO).repeat_interleave(seq)
    causal = (position_ids.to(torch.int64) + 1) // COMPRESS_RATIO
    return torch.minimum(cache_len, causal).clamp(max=model.max_position_embeddings // COMPRESS_RATIO)


def select_topk(score: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k slots per token, int32 [T, k]: descending score, ascending slot on ties, −1 padded.

    Only slots `< visible[t]` compete; a token keeps `min(k, visible[t])` of them.
    """
    t, u = score.shape
    slot = torch.arange(u, dtype=torch.int64, device=score.device)
    masked = score.masked_fill(slot[None, :] >= visible[:, None], float("-inf"))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :k]
    if order.shape[1] < k:
        order = torch.cat((order, order.new_full((t, k - order.shape[1]), -1)), dim=1)
    rank = torch.arange(k, dtype=torch.int64, device=score.device)
    return torch.where(rank[None, :] < visible[:, None].clamp(max=k), order, torch.full_like(order, -1)).to(torch.int32)


__all__ = [
    "hadamard_rotate",
    "commit_idx_rows",
    "query",
    "head_weights",
    "cache_rows",
    "scores",
    "visible_slots",
    "select_topk",
]
