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
    w: torch.Tensor, *, axis: int, half_away_from_zero: bool = False, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixture-side int8 weight quantization with clamp to +-127 (spec §8.12 table).

    `axis` is the reduction axis of the amax: 0 for the per-output-column quant of an
    `[in, out]` weight (wq_b), -1 for the per-row quant of an `[out, in]` weight (wo_b).
    SWA and HCA fixtures round half to even; the CSA fixture rounds half away from zero.
    Returns `(int8 like w, fp32 scale with `axis` reduced)`; the codes are written into `out`
    (an int8 2-D view, e.g. some columns of a wider weight) if given.
    """
    return quantize_weight_int8(w, weight_amax(w, axis=axis), axis=axis, half_away_from_zero=half_away_from_zero,
                                out=out)


# Values per row block of the streamed weight quantizers: 1 MiB of fp32, which stays in the
# cache. A flash weight is ~33M values; a full-size fp32 copy of it, and each full-size
# temporary, would cost a page fault per 4 KiB (~70 ms per 128 MiB here) and a trip through
# memory per pass.
_QUANT_BLOCK_VALUES = 1 << 18


def _weight_rows(w: torch.Tensor, axis: int) -> tuple[torch.Tensor, bool]:
    """`(2-D view, per_row)`: the view the quantizers walk by row blocks, `[-1, last]` for the
    per-row amax (the last axis), the weight itself for the per-column one (axis 0, 2-D)."""
    if axis in (-1, w.dim() - 1):
        return w.reshape(-1, w.shape[-1]), True
    if axis == 0 and w.dim() == 2:
        return w, False
    raise ValueError(f"int8 weight quantization reduces axis 0 of a 2-D weight or the last axis, got axis {axis} of {w.dim()}-D")


def _row_step(rows: torch.Tensor) -> int:
    return max(1, _QUANT_BLOCK_VALUES // max(1, rows.shape[1]))


def weight_amax(w: torch.Tensor, *, axis: int) -> torch.Tensor:
    """max |w| along `axis`, keepdim, fp32: row blocks widened into one fp32 buffer, max |w| as
    max(max w, −min w) (two reductions, no |w| temporary; reductions over bf16 are slower)."""
    rows, per_row = _weight_rows(w, axis)
    n, width = rows.shape
    step = _row_step(rows)
    d = 1 if per_row else 0
    amax = torch.zeros((n, 1) if per_row else (1, width), dtype=torch.float32, device=w.device)
    buf = torch.empty(min(n, step) * width, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, step):
        block = rows[r0 : r0 + step]
        v = buf[: block.numel()].view(block.shape).copy_(block)
        m = torch.maximum(v.amax(dim=d, keepdim=True), v.amin(dim=d, keepdim=True).neg_())
        if per_row:
            amax[r0 : r0 + step] = m
        else:
            torch.maximum(amax, m, out=amax)
    return amax.reshape(*w.shape[:-1], 1) if per_row else amax


def quantize_weight_int8(
    w: torch.Tensor, amax: torch.Tensor, *, axis: int, half_away_from_zero: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_weight_int8` with the amax given (keepdim along `axis`; e.g. the amax of whole
    rows of which w holds some columns), into `out` (int8 like w, may be a strided view) if
    given. Row block by row block in one fp32 buffer, every step in place on it: all exact, so
    the blocking changes no bit."""
    scale_quant = INT8_SCALE_MAX / amax.clamp_min(INT8_AMAX_EPS)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device) if out is None else out
    (rows, per_row), (q_rows, _) = _weight_rows(w, axis), _weight_rows(q, axis)
    sq = scale_quant.reshape(-1, 1) if per_row else scale_quant
    n, width = rows.shape
    step = _row_step(rows)
    buf = torch.empty(min(n, step) * width, dtype=torch.float32, device=w.device)
    sign = torch.empty_like(buf) if half_away_from_zero else None
    for r0 in range(0, n, step):
        block = rows[r0 : r0 + step]
        v = buf[: block.numel()].view(block.shape).copy_(block)
        v.mul_(sq[r0 : r0 + step] if per_row else sq)
        if half_away_from_zero:
            # trunc(v ± 0.5) = sign(v)·floor(|v| + 0.5): fp32 addition is symmetric in sign.
            # The truncation is the float -> int8 conversion's own (C++ casts truncate toward
            # zero), after the clamp: trunc_ has no vectorized CPU kernel (~20x a rounding).
            v.add_(torch.sign(v, out=sign[: v.numel()].view(v.shape)), alpha=0.5)
        else:
            v.round_()
        # Values within ±127 convert to int8 exactly (integral ones), as int32 -> fp16 -> int8 did.
        q_rows[r0 : r0 + step].copy_(v.clamp_(-127, 127))
    return q, (1.0 / scale_quant).squeeze(axis)


# Every float8_e4m3fn value by its bits, as fp32: the fp8 -> fp32 conversion has no
# vectorized CPU kernel (~10 ns a value, 40x the other way), a lookup is exact and ~5x faster.
_E4M3_BY_BITS = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`f32(x.to(float8_e4m3fn))`: x rounded to the nearest e4m3 value, as fp32 (bit for bit)."""
    bits = x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    return torch.index_select(_E4M3_BY_BITS.to(x.device), 0, bits.reshape(-1)).view(x.shape)


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
