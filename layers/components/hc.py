"""Hyper-connection pre-mix and post-mix of the attention sublayer (spec components.md §3, §4).

Owns `hc_pre` (inverse RMS over the four streams, the mixing GEMM with the Ascend A2/A3 cube
emulation, the pre/post gates, Sinkhorn, the stream mix) and `hc_post` (the next hc stream
from the sublayer output). Both are row-wise (per token) functions; fp32 end to end except
`x_mixed`, rounded to bf16 once.
"""

from __future__ import annotations

import torch

from ..contract.config import ModelConfig
from .numerics import bf16, f32

# Chunk width of the sum of squares of hc_pre's inverse RMS (RMS_K_CHUNK).
RMS_K_CHUNK = 512
# The cube emulation: K is split in LINEAR_OK equal splits, each walked in groups of
# CUBE_GROUP consecutive columns; GROUP_BLOCK groups are formed at once (bounds memory only).
LINEAR_OK = 4
CUBE_GROUP = 4
GROUP_BLOCK = 64
# torch runs an elementwise op on one thread below this many elements (at::internal::GRAIN_SIZE).
# The sequential group loop issues thousands of small ops; keeping each below the grain
# avoids a thread hand-off per op, which dominates on a loaded 2-core machine.
_SERIAL_NUMEL = 32768


def a2a3_cube_linear(xf: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`xf [T, K] @ w [M, K]ᵀ` as the A2/A3 fp32 cube computes it (§3.3), fp32 [T, M].

    Per split s and output (t, m): groups of 4 products are summed in fp64 (the products are
    exact), each group sum is added to an fp32 accumulator in fp64 and rounded back to fp32,
    groups in ascending order; the 4 split results are then summed in ascending order in fp32.
    """
    t, k = xf.shape
    m = w.shape[0]
    if k % (LINEAR_OK * CUBE_GROUP):
        raise ValueError(f"cube emulation needs K % {LINEAR_OK * CUBE_GROUP} == 0, got K={k}")
    gs = k // (LINEAR_OK * CUBE_GROUP)  # groups per split
    # [g, s, T, c] @ [g, s, c, M]: one small fp64 GEMM per (group, split) forms the 4-term
    # group sums of every (t, m) at once.
    xg = xf.to(torch.float64).reshape(t, LINEAR_OK, gs, CUBE_GROUP).permute(2, 1, 0, 3).contiguous()
    wg = w.to(torch.float64).reshape(m, LINEAR_OK, gs, CUBE_GROUP).permute(2, 1, 3, 0).contiguous()
    tile = max(1, _SERIAL_NUMEL // (LINEAR_OK * m))
    tiles = [(t0, min(t0 + tile, t)) for t0 in range(0, t, tile)]
    acc32 = [torch.zeros(LINEAR_OK, t1 - t0, m, dtype=torch.float32, device=xf.device) for t0, t1 in tiles]
    acc64 = torch.empty(LINEAR_OK, min(tile, t), m, dtype=torch.float64, device=xf.device)
    for g0 in range(0, gs, GROUP_BLOCK):
        sums = torch.matmul(xg[g0 : g0 + GROUP_BLOCK], wg[g0 : g0 + GROUP_BLOCK])  # [g, s, T, M] fp64
        for (t0, t1), acc in zip(tiles, acc32):
            wide = acc64[:, : t1 - t0]
            # Sequential over groups: the accumulator is rounded to fp32 after every group,
            # so the order of the additions is part of the result.
            for g in range(sums.shape[0]):
                torch.add(acc, sums[g, :, t0:t1], out=wide)
                acc.copy_(wide)
    part = torch.cat(acc32, dim=1)  # [s, T, M]
    return ((part[0] + part[1]) + part[2]) + part[3]


def _inverse_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """`rsqrt(ssq · fp32(1/HCD) + eps)` [T] with ssq summed per 512-column chunk, chunks ascending."""
    t, k = xf.shape
    ssq = torch.zeros(t, dtype=torch.float32, device=xf.device)
    # A handful of chunks (32 at FLASH); the chunk order is part of the result.
    for k0 in range(0, k, RMS_K_CHUNK):
        chunk = xf[:, k0 : k0 + RMS_K_CHUNK]
        ssq = ssq + (chunk * chunk).sum(dim=-1)
    return torch.rsqrt(ssq * torch.tensor(1.0 / k, dtype=torch.float32, device=xf.device) + eps)


def _sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over j, column norm, then (iters − 1) × (row, column) norms (§3.2 step 4)."""
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def hc_pre(
    x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, model: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mix the four hc streams into one row (§3.2).

    x [T, HC, D] fp32, hc_fn [MIX, HCD] fp32, hc_scale [3], hc_base [MIX] →
    `(x_mixed bf16 [T, D], post fp32 [T, HC], comb fp32 [T, HC·HC])`, comb row-major [in, out].
    """
    t, hc, d = x.shape
    if hc != 4 or hc != model.hc_mult:
        raise ValueError(f"hc_pre mixes exactly 4 streams (hc_mult={model.hc_mult}); got x {tuple(x.shape)}")
    xs = f32(x)
    xf = xs.reshape(t, hc * d)  # column h·D + d is stream h, dim d
    # The eps of the inverse RMS is rms_norm_eps; gates and Sinkhorn use hc_eps (P1).
    rs = _inverse_rms(xf, model.rms_norm_eps)
    mixes = a2a3_cube_linear(xf, f32(hc_fn)) * rs[:, None]  # 1/rms applied after the GEMM
    scale, base = f32(hc_scale), f32(hc_base)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + model.hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    c = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(t, hc, hc)  # c[t, i, j] = column 2HC + HC·i + j
    comb = _sinkhorn(c, model.hc_sinkhorn_iters, model.hc_eps).reshape(t, hc * hc)
    # The pairing (y0 + y1) + (y2 + y3) is the golden's.
    y = (xs[:, 0] * pre[:, 0:1] + xs[:, 1] * pre[:, 1:2]) + (xs[:, 2] * pre[:, 2:3] + xs[:, 3] * pre[:, 3:4])
    return bf16(y), post, comb


def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Next hc stream `y [T, HC, D]` fp32 from the sublayer output x [T, D] bf16 (§4).

    `y[t, o] = f32(x[t])·post[t, o] + Σ_i residual[t, i]·comb[t, HC·i + o]`, the sum over the
    input streams i accumulated in ascending order (the loop over the four streams is that
    order); comb is read [in = i, out = o] (P2).
    """
    t, hc, _ = residual.shape
    comb_io = f32(comb).reshape(t, hc, hc)
    y = f32(x)[:, None, :] * f32(post)[:, :, None]
    for i in range(hc):
        y = y + f32(residual[:, i : i + 1, :]) * comb_io[:, i, :, None]
    return y


__all__ = ["a2a3_cube_linear", "hc_pre", "hc_post"]
