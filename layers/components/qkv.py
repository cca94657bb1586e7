"""Attention RMSNorm and the Q LoRA (W8A8) + KV projection with RoPE (spec components.md §5, §6).

Owns `rms_norm` (the attention RMSNorm of `x_mixed`) and `qkv_proj_rope` (queries of all H
heads, the single latent KV head, and the int8 Q latent the CSA indexer reads). Row-wise in
the tokens; all heads on every rank (no head sharding here).
"""

from __future__ import annotations

import torch

from ..contract.config import ModelConfig
from .numerics import bf16, bf16_matmul, f32, int8_matmul, int8_quant_per_row
from .rope import apply_rope


def _normalize(v: torch.Tensor, eps: float) -> torch.Tensor:
    """`v · rsqrt(mean(v²) + eps)` over the last axis, fp32 (gamma applied by the caller)."""
    return v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """`bf16((f32(x) · rsqrt(mean f32(x)² + eps)) · f32(norm_w))` [T, D] (§5), left to right."""
    return bf16(_normalize(f32(x), eps) * f32(norm_w))


def qkv_proj_rope(
    x_normed: torch.Tensor,
    wq_a: torch.Tensor,
    wq_b: torch.Tensor,
    wq_b_scale: torch.Tensor,
    wkv: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    gamma_cq: torch.Tensor,
    gamma_ckv: torch.Tensor,
    model: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, latent KV and the int8 Q latent of x_normed [T, D] bf16 (§6.2–§6.5).

    Returns `(q bf16 [T, H, HD], kv bf16 [T, HD], qr int8 [T, QL], qr_scale fp32 [T, 1])`; the
    last R dims of every q head and of kv are rotated with the token's rows rope_cos/sin [T, R].
    """
    t = x_normed.shape[0]
    h, hd, n = model.num_attention_heads, model.head_dim, model.nope_head_dim
    eps = model.rms_norm_eps

    # Q path. qr_f stays fp32 (never bf16-rounded) up to the int8 quant.
    a = bf16_matmul(x_normed, wq_a)  # [T, QL]
    qr_f = _normalize(a, eps) * f32(gamma_cq)
    qr, qr_scale = int8_quant_per_row(qr_f)
    q_i = int8_matmul(qr, wq_b)  # [T, H·HD], exact integers as fp32
    q_f = ((q_i * qr_scale) * f32(wq_b_scale)).reshape(t, h, hd)
    q_f = _normalize(q_f, eps)  # per-head norm over all HD dims, no gamma (P6)
    q = torch.empty(t, h, hd, dtype=torch.bfloat16, device=x_normed.device)
    q[..., :n] = bf16(q_f[..., :n])
    q[..., n:] = apply_rope(q_f[..., n:], rope_cos, rope_sin)

    # KV path. gamma_ckv scales the rope columns too, before the rotation (P6).
    k = _normalize(bf16_matmul(x_normed, wkv), eps) * f32(gamma_ckv)  # [T, HD]
    kv = torch.empty(t, hd, dtype=torch.bfloat16, device=x_normed.device)
    kv[:, :n] = bf16(k[:, :n])
    kv[:, n:] = apply_rope(k[:, n:], rope_cos, rope_sin)
    return q, kv, qr, qr_scale


__all__ = ["rms_norm", "qkv_proj_rope"]
