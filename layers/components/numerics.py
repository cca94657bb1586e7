"""Numeric building blocks shared by every layer (spec components.md §2, §8.12).

Owns the rounding conventions (bf16 round-to-nearest-even casts), the per-row int8 activation
quantizer, the fixture-side int8 weight quantizers and the exact int8 x int8 GEMM. Everything
is plain torch on whatever device the tensors live on; nothing here knows about layers.
"""

from __future__ import annotations

import torch

INT8_SCALE_MAX = 127.0
INT8_AMAX_EPS = 1e-4
FP32_NEG_INF = -3.4028234663852886e38

# int8 x int8 products summed over K terms stay below 2**24 (exact in fp32) while
# 127 * 127 * K < 2**24.
_FP32_EXACT_MAX_K = (2**24 - 1) // (127 * 127)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (round half to even), the rounding point of every bf16 value."""
    return x.to(torch.bfloat16)


def f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 product of bf16-rounded operands (spec §2 item 5).

    CPUs have no fast bf16 GEMM: both operands are widened to fp32 first, which gives the
    same result as a bf16-input / fp32-accumulate kernel up to summation order.
    """
    return f32(bf16(a)) @ f32(bf16(b))


def int8_quant_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 activation quantization (spec §2 item 2).

    Returns `(q int8 like x, scale fp32 [..., 1])` with `scale = 1 / (127 / amax)`; rounding is
    half-to-even with no clamp (|x * 127/amax| <= 127 up to one ulp, which rounds to 127).
    """
    rows = f32(x)
    amax = rows.abs().amax(dim=-1, keepdim=True).clamp_min(INT8_AMAX_EPS)
    scale_quant = INT8_SCALE_MAX / amax
    q = torch.round(rows * scale_quant).to(torch.int32).to(torch.float16).to(torch.int8)
    return q, 1.0 / scale_quant


def quant_weight_int8(
    w: torch.Tensor, *, axis: int, half_away_from_zero: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixture-side int8 weight quantization with clamp to +-127 (spec §8.12 table).

    `axis` is the reduction axis of the amax: 0 for the per-output-column quant of an
    `[in, out]` weight (wq_b), -1 for the per-row quant of an `[out, in]` weight (wo_b).
    SWA and HCA fixtures round half to even; the CSA fixture rounds half away from zero.
    Returns `(int8 like w, fp32 scale with `axis` reduced)`.
    """
    # A flash weight is ~33M values: one private fp32 copy, every later step in place on it
    # (all exact, so no bit changes), and max |w| as max(max w, -min w): two fp32 reductions
    # and no |w| temporary (aminmax, and reductions over bf16, are slower).
    v = w.to(torch.float32, copy=True)
    amax = torch.maximum(v.amax(dim=axis, keepdim=True), v.amin(dim=axis, keepdim=True).neg_())
    scale_quant = INT8_SCALE_MAX / amax.clamp_min_(INT8_AMAX_EPS)
    v.mul_(scale_quant)
    if half_away_from_zero:
        # trunc(v ± 0.5) = sign(v)·floor(|v| + 0.5): fp32 addition is symmetric in sign.
        v.add_(torch.full((), 0.5).copysign(v)).trunc_()
    else:
        v.round_()
    # Integral values within ±127 convert to int8 exactly, as int32 -> fp16 -> int8 did.
    q = v.clamp_(-127, 127).to(torch.int8)
    return q, (1.0 / scale_quant).squeeze(axis)


# Columns of the int8 right operand widened at a time (elements): a flash wq_b [1024, 32768]
# widened whole would be a 128 MiB fp32 transient on every rank.
_WIDEN_CHUNK_ELEMENTS = 1 << 22


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 x int8 GEMM, returned as fp32 (= fp32(int32 product), spec §2 item 4).

    fp32 accumulation is exact while every partial sum stays below 2**24 (K <= 1040); beyond
    that the product is formed in fp64 (exact for any K here) and rounded once to fp32, which
    equals the int32 -> fp32 conversion of the golden. Works on backends without an int32
    GEMM (CUDA, NPU); TF32/HF32 must be off there (the launcher does so).
    """
    k = a.shape[-1]
    wide = torch.float32 if k <= _FP32_EXACT_MAX_K else torch.float64
    aw = a.to(wide)
    n = b.shape[-1]
    cols = max(1, _WIDEN_CHUNK_ELEMENTS // max(1, b.numel() // max(1, n)))
    if a.dim() < 2 or b.dim() < 2 or n <= cols:
        return (aw @ b.to(wide)).to(torch.float32)
    # A loop over a few column tiles of b, widened one at a time: every sum is an exact
    # integer in `wide`, so no tiling or summation order can change a bit. The first tile's
    # product gives the batch shape (torch.broadcast_shapes would import sympy, ~0.4 s).
    first = aw @ b[..., :cols].to(wide)
    out = torch.empty((*first.shape[:-1], n), dtype=torch.float32, device=a.device)
    out[..., :cols] = first
    for j in range(cols, n, cols):
        out[..., j : j + cols] = aw @ b[..., j : j + cols].to(wide)
    return out
