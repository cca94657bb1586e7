"""Sparse decode attention shared by the SWA, CSA and HCA layers, and its output packing.

Owns the exact golden math of swa.md §3.5 / csa.md §4.9 / hca.md §4.6 — multi-query
attention of every head over a per-token list of gathered latent rows (K = V), masked
softmax in tiles of `ATTN_K_TILE` keys with an online-softmax merge across tiles, an
attention sink that only enlarges the denominator — plus the gather of those rows from a
paged pool by flat row index, and the inverse RoPE + group-major packing of the output
(swa.md §3.6) that is the contract with the TP output half (swa.md §5.2).

It does not build key lists (window / compressed selection belongs to each layer) and
knows nothing of caches being written or of tensor parallelism.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import rope
from ..contract.config import ModelConfig, ceil_div
from .numerics import bf16, f32

# Mask value of the SWA/CSA/HCA attention modules (swa.md §1.2, P2): exp(NEG_INF - m) is
# exactly 0 and, unlike -inf, an all-masked tile gives no inf - inf NaN.
NEG_INF = -1.0e20
# Keys per softmax tile: the tiling fixes where exps are rounded to bf16 (each tile's exps
# are relative to its own max), so it is part of the numerics, not a performance knob.
ATTN_K_TILE = 128
# fp32 elements of one token chunk's key tile; bounds memory at FLASH dims (512-wide heads,
# 512 tokens) without changing any value, since every token is computed independently.
_CHUNK_ELEMENTS = 1 << 23


def exp_rounded_from_fp64(x: torch.Tensor) -> torch.Tensor:
    """`exp` of an fp32 tensor evaluated in fp64 and rounded once to fp32: the correctly rounded
    value (up to a double rounding of ~2^-29 relative), the same on every machine and backend.

    torch.exp on CPU is MKL's VML, whose fp32 result depends on the code branch MKL picks: its
    AVX2 / AVX-512 branches (what `MKL_CBWR=AVX2,STRICT` pins) round ~3 % of the attention's exps
    one ulp off the correctly rounded value, its AVX / SSE4.2 / COMPATIBLE branches ~0.8 %.
    With it every layer's golden reproduces the reference snapshots bit for bit (with the AVX2
    exp, one HCA token lands 1 ulp off). NPUs may lack fp64 arithmetic: there the plain fp32
    exp is used, which the tolerances absorb.
    """
    if x.device.type == "npu":
        return torch.exp(x)
    return torch.exp(x.double()).to(x.dtype)


def gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a paged pool by flat physical index; −1 marks an invalid entry.

    pool [NB, BS, 1, HD] (any shape ending in HD; flat row = block·BS + slot), rows int [T, K].
    Returns `(kv [T, K, HD] in pool's dtype, valid [T, K] bool)`. Invalid entries are zero
    rows, never a clamped real row, so a NaN-poisoned cache row cannot reach attention (P4).
    """
    flat = pool.reshape(-1, pool.shape[-1])
    valid = rows >= 0
    kv = torch.index_select(flat, 0, rows.clamp(min=0).reshape(-1).to(torch.int64))
    return zero_rows_(kv, ~valid.reshape(-1)).view(*rows.shape, flat.shape[-1]), valid


def zero_rows_(rows: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """Zero rows `which` (bool [R]) of rows [R, D] in place: the rows are written, never scaled,
    so a NaN in a masked row is gone too (P4). A fill of the few listed rows, where a
    broadcast masked_fill_ tests every element (~1000x slower for a [T, 640, 512] gather)."""
    return rows.index_fill_(0, torch.nonzero(which).reshape(-1), 0)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    attn_sink: torch.Tensor,
    softmax_scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor] = exp_rounded_from_fp64,
) -> torch.Tensor:
    """Attention of q [T, H, HD] bf16 over kv [T, K, HD] bf16 (keys = values) where valid [T, K].

    Exactly `golden_sparse_attn`: keys padded with invalid zero rows to whole tiles of 128;
    per tile fp32 scores `(q·k)·scale`, NEG_INF where invalid, tile max (sink excluded),
    `e = exp(s − m)` zeroed where invalid, `l = Σ e` from the unrounded exps,
    `o = bf16(e) @ k` accumulated in fp32; tiles merged in order with `α = exp(m − m')`,
    `β = exp(m_j − m')`; finally `o / (l + exp(sink − m))`. A token without any valid key
    gets zeros (P1). Returns fp32 [T, H, HD].

    Tile j holds keys `[128·j, 128·j + 128)` of the list as given: a layer whose key segments
    each start on a tile (HCA's compressed rows after the window) pads its segments itself.
    An all-invalid tile (extra padding tiles included) leaves the merge bitwise unchanged.

    `exp` evaluates every exp of the softmax, the merge and the sink term; the default is the
    correctly rounded `exp_rounded_from_fp64`, independent of the CPU's math-library branch.
    """
    t, h, hd = q.shape
    if t == 0:
        return torch.zeros(0, h, hd, dtype=torch.float32, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // (ATTN_K_TILE * hd))
    parts = [
        _attend_chunk(q[i : i + chunk], kv[i : i + chunk], valid[i : i + chunk], attn_sink, softmax_scale, exp)
        for i in range(0, t, chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def window_attention(
    model: ModelConfig,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    attn_sink: torch.Tensor,
) -> torch.Tensor:
    """Window attention (swa.md §3.5): o fp32 [T, H, HD] of q [T, H, HD] over each token's window.

    Key k of token t is valid iff `k < swa_lens[t]` and `swa_indices[t, k] >= 0` (the
    golden's rule; the kernel masks by lens only, §12.1).
    """
    kv, valid = gather_rows(kv_cache, swa_indices)  # [T, WIN, HD], [T, WIN]
    in_window = torch.arange(swa_indices.shape[1], device=swa_lens.device)[None, :] < swa_lens[:, None]
    return sparse_attention(q, kv, valid & in_window, attn_sink, model.softmax_scale)


def _attend_chunk(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    attn_sink: torch.Tensor,
    softmax_scale: float,
    exp: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    t, k = valid.shape
    qf = f32(q)
    m = l = o = None
    # One fp32 key tile, reused by every tile (a fresh one per tile would be page-faulted in);
    # every step below is in place on the step's own temporaries: the same values, less memory.
    kt = torch.empty(t, ATTN_K_TILE, kv.shape[-1], dtype=torch.float32, device=kv.device)
    # The tiles are merged in order: the merge is the golden's sequential online softmax.
    for j in range(max(1, ceil_div(k, ATTN_K_TILE))):
        tile = slice(j * ATTN_K_TILE, (j + 1) * ATTN_K_TILE)
        vt = valid[:, tile]
        width = vt.shape[1]
        kt[:, :width].copy_(kv[:, tile])
        if width < ATTN_K_TILE:  # a short last tile: invalid zero keys up to the full 128 (the GEMM shapes)
            kt[:, width:].zero_()
            vt = torch.cat((vt, vt.new_zeros(t, ATTN_K_TILE - width)), dim=1)
        # Zero masked rows again (P4): the PV product multiplies them by bf16(e) = 0.
        zero_rows_(kt.view(-1, kt.shape[-1]), ~vt.reshape(-1))  # [T, 128, HD]
        invalid_j = ~vt[:, None, :]  # [T, 1, 128]
        s = torch.matmul(qf, kt.transpose(1, 2)).mul_(softmax_scale)  # [T, H, 128]
        s.masked_fill_(invalid_j, NEG_INF)
        m_j = s.amax(dim=-1, keepdim=True)
        e = exp(s.sub_(m_j)).masked_fill_(invalid_j, 0.0)
        l_j = e.sum(dim=-1, keepdim=True)  # P6: unrounded exps
        o_j = torch.matmul(f32(bf16(e)), kt)  # bf16 probabilities, fp32 accumulate
        if j == 0:
            m, l, o = m_j, l_j, o_j
            continue
        m_new = torch.maximum(m, m_j)
        alpha = exp(m - m_new)
        beta = exp(m_j - m_new)
        l = alpha * l + beta * l_j
        o = o.mul_(alpha).add_(o_j.mul_(beta))
        m = m_new
    denom = l + exp(f32(attn_sink)[None, :, None] - m)  # P5: sink not in the max
    out = o / denom
    # P1: a token with no valid key is skipped by the golden (zeros), not computed.
    return torch.where(valid.any(dim=1)[:, None, None], out, torch.zeros_like(out))


def pack_heads(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Inverse RoPE and group-major packing of the attention output (swa.md §3.6).

    o fp32 [T, H, HD]; cos / sin the token-local rope rows [T, R] bf16. Each head becomes
    `concat(bf16(o[:NOPE]), inverse_rope(o[NOPE:]))` (rope part rounded from the fp32
    rotation), and `attention_grouped[g, t, j·HD + d] = head[t, g·HPG + j, d]`.
    Returns attention_grouped bf16 [G, T, GI] (no padding rows).
    """
    t = o.shape[0]
    nope = model.nope_head_dim
    heads = torch.cat((bf16(o[..., :nope]), rope.apply_inverse_rope(o[..., nope:], cos, sin)), dim=-1)
    # [T, H, HD] -> [T, G, HPG·HD] -> [G, T, GI]
    return heads.reshape(t, model.o_groups, model.group_in).transpose(0, 1).contiguous()


__all__ = ["NEG_INF", "ATTN_K_TILE", "exp_rounded_from_fp64", "gather_rows", "zero_rows_", "sparse_attention", "window_attention",
           "pack_heads"]
