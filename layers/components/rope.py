"""RoPE / YaRN tables and the interleaved rotations (spec components.md §6.4, §7, §8.11).

Owns the angle tables (full tables and token-local rows of the same values), the choice of
RoPE profile per compress ratio, and the forward / inverse rotation of the last R dims of a
head. Rows are bf16 `[N, R]` with the second half duplicating the first; the rotations read
only the first R/2 columns. Nothing here knows about caches or layers.
"""

from __future__ import annotations

import math

import torch

from ..contract.config import ModelConfig
from .numerics import bf16, f32

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "torch.float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "torch.float16": torch.float16,
}


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"unsupported rope table dtype {dtype!r}; use bf16, fp32 or fp16")


def inv_freq(
    dim: int, original_seq_len: int, base: float, factor: float, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """Per-pair inverse frequencies [dim/2] fp32, YaRN-corrected when original_seq_len > 0 (§8.11)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:

        def correction_dim(rotations: float) -> float:  # Python double, as the reference
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        # The correction range is computed with `dim`, the ramp spans only dim/2 pairs.
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        # Evaluated literally (not as `inv * ramp / factor + ...`): the fp32 result differs.
        inv = inv / factor * (1 - smooth) + inv * smooth
    return inv


def _cos_sin(positions_f32: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 angles (P7): fp64 angles change ~1 % of the bf16 values at 8k-16k positions.
    ang = torch.outer(positions_f32, inv)
    cos_h, sin_h = torch.cos(ang), torch.sin(ang)
    return torch.cat((cos_h, cos_h), dim=-1).to(dtype), torch.cat((sin_h, sin_h), dim=-1).to(dtype)


def _check_dim(dim: int) -> None:
    if not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(f"rope dim must be a positive even integer, got {dim!r}")


def precompute_freqs_cos_sin(
    dim: int,
    seqlen: int,
    original_seq_len: int,
    base: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full tables `(freqs_cos, freqs_sin)`, each [seqlen, dim] (spec §8.11)."""
    _check_dim(dim)
    if not isinstance(seqlen, int) or seqlen <= 0:
        raise ValueError(f"rope table seqlen must be a positive integer, got {seqlen!r}")
    inv = inv_freq(dim, original_seq_len, base, factor, beta_fast, beta_slow)
    return _cos_sin(torch.arange(seqlen, dtype=torch.float32), inv, _resolve_dtype(dtype))


def rope_profile(model: ModelConfig, compress_ratio: int) -> tuple[float, int]:
    """`(base, original_seq_len)` of a layer: SWA (ratio 0) plain θ, CSA/HCA θ_c with YaRN."""
    if compress_ratio == 0:
        return model.rope_theta, 0
    return model.compress_rope_theta, model.original_max_position_embeddings


def rope_rows(
    model: ModelConfig,
    positions: torch.Tensor,
    compress_ratio: int,
    *,
    dim: int | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Table rows at `positions` (flattened) of the layer's profile, each [N, dim].

    Only the needed rows are computed (a 1 Mi-row table would be 128 MiB); they are bitwise
    the rows of `precompute_freqs_cos_sin` at those positions, since every step is row-local
    and positions up to 2**24 are exact in fp32.
    """
    dim = model.qk_rope_head_dim if dim is None else dim
    _check_dim(dim)
    base, original_seq_len = rope_profile(model, compress_ratio)
    inv = inv_freq(dim, original_seq_len, base, model.rope_factor, model.beta_fast, model.beta_slow)
    return _cos_sin(f32(positions.reshape(-1)), inv, _resolve_dtype(dtype))


def _half_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `c_i, s_i` [T, 1, ..., R/2], broadcastable against the pairs of x [T, ..., R]."""
    r = x.shape[-1]
    if r % 2:
        raise ValueError(f"rotated width must be even, got {r}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[0] or cos.shape[1] not in (r, r // 2):
        raise ValueError(
            f"rope rows must be [T, R] or [T, R/2] with T={x.shape[0]}, R={r}; got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    # Full-width rows duplicate the first half (§8.11); only c_i, s_i for i < R/2 are read.
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    return f32(cos[:, : r // 2]).reshape(view), f32(sin[:, : r // 2]).reshape(view)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Forward interleaved rotation of x [T, ..., R] by per-token rows [T, R] (or [T, R/2]).

    Pairs `(e, o) = (x[2i], x[2i+1])` become `(bf16(e·c − o·s), bf16(e·s + o·c))` (§6.4): each
    element is rounded to bf16 on its own, from fp32 products of the fp32 inputs. The same
    row serves every middle index (heads) of the token. Returns bf16 [T, ..., R].
    """
    c, s = _half_rows(x, cos, sin)
    xf = f32(x)
    e, o = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((bf16(e * c - o * s), bf16(e * s + o * c)), dim=-1).flatten(-2)


def apply_inverse_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse (conjugate) rotation, `(bf16(e·c + o·s), bf16(o·c − e·s))` (swa.md §3.6), bf16 [T, ..., R]."""
    c, s = _half_rows(x, cos, sin)
    xf = f32(x)
    e, o = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((bf16(e * c + o * s), bf16(o * c - e * s)), dim=-1).flatten(-2)


__all__ = ["inv_freq", "precompute_freqs_cos_sin", "rope_profile", "rope_rows", "apply_rope", "apply_inverse_rope"]
