"""The grouped output projection of the attention layers: TP1 golden and per-rank shard.

Owns the math of swa.md §3.7 (`golden_decode_o_proj_tp1`) and §5.4 (`decode_o_proj`, the
projection of one rank's LG output groups over every token of the TP group): an fp32 GEMM
with wo_a per group (K accumulated in blocks of `WO_A_K_BLOCK`, the reference's order),
per-(group, token) int8 activation quantization, an exact int8 GEMM
with the group's wo_b columns, the dequantized groups summed in ascending order, and the
per-output-channel wo_b_scale. Pure tensor math: the collectives around the sharded form
live in `layers.tp`.
"""

from __future__ import annotations

import torch

from .numerics import bf16, f32, int8_matmul, int8_quant_per_row

# K block of the fp32 wo_a GEMM (see `sharded_o_proj`).
WO_A_K_BLOCK = 128


def sharded_o_proj(
    x_local_groups: torch.Tensor, wo_a_r: torch.Tensor, wo_b_r: torch.Tensor, wo_b_scale: torch.Tensor
) -> torch.Tensor:
    """One rank's fp32 partial of the output projection (swa.md §5.4).

    x_local_groups [LG, U, GI] bf16 (U = P·t rows of the rank's groups), wo_a_r [LG, OL, GI]
    bf16, wo_b_r [D, LG·OL] int8 (column block lg is the rank's lg-th group), wo_b_scale [D]
    fp32 (the full weight's per-row scale, replicated — never re-derived per shard, P10).
    Returns o_partial fp32 [U, D] = `(Σ_lg fp32(I_lg)·sdq[lg]) · wo_b_scale`; wo_b_scale is
    applied here, per rank, before any cross-rank sum.
    """
    lg, u, gi = x_local_groups.shape
    d = wo_b_r.shape[0]
    ol = wo_a_r.shape[1]
    a = f32(x_local_groups)
    # Y[lg, u, r] = Σ_i A·wo_a: bf16 operands widened, fp32 GEMMs batched over groups, K in
    # blocks of WO_A_K_BLOCK whose partials are added in ascending order (a loop over a few
    # K blocks: the order is the point). The blocking is for bit parity with the reference:
    # its golden einsum, as run for the snapshots, sums K that way. Measured at GI = 256
    # (swa/csa-tp2-64 both ranks, hca-tp2-64 rank 1): two 128-wide blocks reproduce x_out
    # bit for bit; one 256-wide GEMM flips int8 codes / amax ulps of a few tokens. wo_a is
    # widened one K block at a time into one buffer: the golden's full fp32 wo_a would be 128 MiB
    # at flash.
    y = None
    w = torch.empty(lg, ol, min(gi, WO_A_K_BLOCK), dtype=torch.float32, device=x_local_groups.device)
    for k0 in range(0, gi, WO_A_K_BLOCK):
        k = slice(k0, k0 + WO_A_K_BLOCK)
        wk = w[..., : min(gi - k0, WO_A_K_BLOCK)].copy_(wo_a_r[..., k])
        part = torch.matmul(a[..., k], wk.transpose(1, 2))  # [LG, U, OL]
        y = part if y is None else y.add_(part)
    # Per (group, token) quantization over the OL lora outputs: never across groups, which
    # is what makes the projection shardable by group.
    q, scale_dq = int8_quant_per_row(y)  # [LG, U, OL] int8, [LG, U, 1]
    wb = wo_b_r.reshape(d, lg, ol).permute(1, 2, 0)  # [LG, OL, D]
    i_groups = int8_matmul(q, wb)  # exact int32 values, as fp32 [LG, U, D]
    acc = torch.zeros(u, d, dtype=torch.float32, device=x_local_groups.device)
    # Ascending group order from 0.0: the golden's fp32 summation order (in place: same values).
    for g in range(lg):
        acc.add_(i_groups[g].mul_(scale_dq[g]))
    return acc.mul_(f32(wo_b_scale)[None, :])


def grouped_o_proj(
    attention_grouped: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, wo_b_scale: torch.Tensor
) -> torch.Tensor:
    """TP1 grouped output projection (swa.md §3.7): attn_out bf16 [T, D].

    attention_grouped [G, T, GI] bf16, wo_a [G, OL, GI] bf16, wo_b [D, G·OL] int8,
    wo_b_scale [D] fp32. The G groups are summed in ascending order, then multiplied by
    wo_b_scale once and rounded to bf16 — the one-rank case of `sharded_o_proj`.
    """
    return bf16(sharded_o_proj(attention_grouped, wo_a, wo_b, wo_b_scale))


__all__ = ["WO_A_K_BLOCK", "sharded_o_proj", "grouped_o_proj"]
