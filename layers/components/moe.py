"""The MoE feed-forward's per-rank math: gate, shared expert, routed expert, reduce (moe.md §4).

Pure tensor functions of one rank's tensors (no torch.distributed, no layout across ranks):
the router gate of §4.2 (deferred-scale RMSNorm, int8 codes, sqrt-softplus scores, hash or
biased top-k choice, normalised and scaled weights), the SwiGLU experts of §4.3 / §4.5 on int8
activations with per-channel int8 weights, and the reduce of §3.3. How routes are laid out
between ranks lives in `layers.components.moe_routing`; the collectives that move them in
`layers.distributed.ep`.

Numerics follow the golden (§4.8), not the device (§5): weights are dequantized to fp32 and
multiplied by fp32 GEMMs, with the rounding points of §4.8 as explicit casts. A weight is
dequantized one expert at a time (elementwise, so no bit changes): a flash rank's 16 experts
at once would be 1.5 GiB of fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contract.config import ModelConfig
from .numerics import bf16, f32, int8_quant_per_row


def active_tokens(num_tokens: torch.Tensor | int, tokens: int) -> int:
    """n = clamp(num_tokens, 0, T) (§2: the kernel and the golden both clamp the scalar)."""
    return max(0, min(int(num_tokens), tokens))


def dequant_rows(w_i8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`f32(w) · scale[..., None]`: an [.., out, in] int8 weight with per-output-row scales."""
    return w_i8.to(torch.float32).mul_(f32(scale)[..., None])


# -- §4.2 gate ---------------------------------------------------------------------------------
def gate(
    x_mixed: torch.Tensor, norm_w: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor,
    tid2eid: torch.Tensor, input_ids: torch.Tensor, layer_id: int, num_tokens: int, model: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router gate on all T rows, then masked to the n active ones (§4.2).

    x_mixed [T, D] bf16, norm_w [D] bf16, gate_w [E, D] fp32, gate_bias [E] fp32,
    tid2eid [V, K] int32, input_ids [T] int64 → `(x_norm_i8 [T, D] int8, x_norm_scale [T, 1]
    fp32, indices [T, K] int32 global expert ids, weights [T, K] fp32)`.

    The RMSNorm is deferred: the codes quantize `x · norm_w` and inv_rms enters only the
    scale and the logits (it would cancel in the codes). Rows t >= n get scale, indices and
    weights 0 but keep their codes (pitfall 4).
    """
    t, d = x_mixed.shape
    k = model.num_experts_per_tok
    n = active_tokens(num_tokens, t)
    xf = f32(x_mixed)
    # torch's sum over the last axis, times the Python float 1/D, then eps: the golden's ops.
    inv_rms = torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) * (1.0 / d) + model.rms_norm_eps)  # [T, 1]
    xg = xf * f32(norm_w)
    x_norm_i8, dq = int8_quant_per_row(xg)
    x_norm_scale = dq * inv_rms  # dq first, then inv_rms (§4.8; the device forms amax/127·inv_rms)
    logits = (xg @ f32(gate_w).t()) * inv_rms  # [T, E]
    # Stable softplus (max(l, 0) + log1p(exp(-|l|))), then sqrt: scoring_func sqrtsoftplus.
    scores = torch.sqrt(logits.clamp_min(0.0) + torch.log1p(torch.exp(-logits.abs())))
    if layer_id < model.num_hash_layers:
        # Hash layer: the table's order is kept; scores and bias play no part in the choice.
        indices = tid2eid[input_ids.long()].to(torch.int32)
    else:
        biased = scores + f32(gate_bias)
        # Stable descending sort: ties go to the lower expert id.
        indices = torch.argsort(-biased, dim=-1, stable=True)[:, :k].to(torch.int32)
    # Weights from the unbiased scores of the chosen experts (pitfall 5), torch's row sum.
    v = torch.gather(scores, 1, indices.long())
    weights = (v / v.sum(dim=-1, keepdim=True)) * model.routed_scaling_factor
    x_norm_scale[n:] = 0.0
    indices[n:] = 0
    weights[n:] = 0.0
    return x_norm_i8, x_norm_scale, indices, weights


# -- §4.3 / §4.5 the SwiGLU experts ------------------------------------------------------------
def _swiglu_int8(
    xq: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, model: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q8(silu(min(xq·W1ᵀ, L)) · clamp(xq·W3ᵀ, −L, L))` with W1, W3 fp32 [I, D]: (h8, hdq)."""
    lim = model.swiglu_limit
    g = (xq @ w1.t()).clamp_max(lim)
    u = (xq @ w3.t()).clamp(-lim, lim)
    return int8_quant_per_row(F.silu(g) * u)


def shared_expert(
    x_norm_i8: torch.Tensor, x_norm_scale: torch.Tensor,
    shared_w1: torch.Tensor, shared_w1_scale: torch.Tensor,
    shared_w3: torch.Tensor, shared_w3_scale: torch.Tensor,
    shared_w2: torch.Tensor, shared_w2_scale: torch.Tensor, model: ModelConfig,
) -> torch.Tensor:
    """sh [T, D] bf16 on every row (§4.3); an inactive row (scale 0) gives exactly 0."""
    xl = f32(x_norm_i8) * x_norm_scale
    h8, hdq = _swiglu_int8(xl, dequant_rows(shared_w1, shared_w1_scale), dequant_rows(shared_w3, shared_w3_scale), model)
    hq = f32(h8) * hdq
    return bf16(hq @ dequant_rows(shared_w2, shared_w2_scale).t())


def routed_expert(
    x8: torch.Tensor, xs: torch.Tensor, wr: torch.Tensor,
    w1: torch.Tensor, w1_scale: torch.Tensor, w3: torch.Tensor, w3_scale: torch.Tensor,
    w2: torch.Tensor, w2_scale: torch.Tensor, model: ModelConfig,
) -> torch.Tensor:
    """One local expert on its c rows (§4.5): y [c, D] bf16, already × the routing weight.

    x8 [c, D] int8, xs [c, 1] and wr [c, 1] fp32 (token dequant scale, routing weight);
    w1 / w3 [I, D], w2 [D, I] int8 with per-output-row scales. The weight is folded into the
    row dequant scale (`hdq · wr`) before the down projection and its bf16 rounding
    (pitfall 6). fp32 GEMM results may depend on the row count: callers batch one expert's
    rows as the golden does, in the receive order of §3.1 (pitfall 10).
    """
    xq = f32(x8) * xs
    h8, hdq = _swiglu_int8(xq, dequant_rows(w1, w1_scale), dequant_rows(w3, w3_scale), model)
    hq = f32(h8) * (hdq * wr)
    return bf16(hq @ dequant_rows(w2, w2_scale).t())


def routed_experts(
    recv_count: torch.Tensor, recv_x: torch.Tensor, recv_aux: torch.Tensor,
    routed_w1: torch.Tensor, routed_w1_scale: torch.Tensor, routed_w3: torch.Tensor, routed_w3_scale: torch.Tensor,
    routed_w2: torch.Tensor, routed_w2_scale: torch.Tensor, model: ModelConfig,
) -> torch.Tensor:
    """Every local expert on its received rows: recv_y [R, D] bf16 (§4.5, §3 `expert_routed`).

    recv_count [L] int: rows per local expert; recv_x [R, D] int8 and recv_aux [R, 2] fp32
    (column 0 token dequant scale, column 1 routing weight) hold expert e's rows at
    `[Σ_{e'<e} recv_count[e'], +recv_count[e])`. One GEMM chain per expert over all its rows
    (experts with no row are skipped, as the golden does).
    """
    recv_y = torch.empty(recv_x.shape[0], recv_x.shape[1], dtype=torch.bfloat16, device=recv_x.device)
    start = 0
    for e, c in enumerate(int(c) for c in recv_count.tolist()):
        if c:
            rows = slice(start, start + c)
            recv_y[rows] = routed_expert(
                recv_x[rows], recv_aux[rows, 0:1], recv_aux[rows, 1:2],
                routed_w1[e], routed_w1_scale[e], routed_w3[e], routed_w3_scale[e],
                routed_w2[e], routed_w2_scale[e], model,
            )  # fmt: skip
        start += c
    return recv_y


# -- §3.3 reduce -------------------------------------------------------------------------------
def reduce(sh: torch.Tensor, routed_y_buf: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """ffn_out [T, D] bf16 = bf16(((f32(sh) + f32(y_k0)) + f32(y_k1)) + …) for t < n, else sh (§3.3).

    routed_y_buf [T·K, D] bf16 holds route (t, k) at row t·K + k; its rows of inactive tokens
    are never read. The order (sh first, then k ascending) fixes the bf16 result (pitfall 7).
    """
    t, d = sh.shape
    n = active_tokens(num_tokens, t)
    acc = sh.to(torch.float32, copy=True)
    routed = routed_y_buf.view(t, -1, d)
    for k in range(routed.shape[1]):
        acc[:n] += f32(routed[:n, k])
    return bf16(acc)


__all__ = ["active_tokens", "dequant_rows", "gate", "shared_expert", "routed_expert", "routed_experts", "reduce"]
