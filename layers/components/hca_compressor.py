"""The ratio-128 non-overlapping KV compressor of the HCA layer (spec hca.md §4.4, §10.1-§10.3).

Owns one decode step of the compressor on one rank: the fp32 kv / score projections, the
paged fp32 state pool (kv half `[0, OUT_DIM)`, score half `[OUT_DIM, 2*OUT_DIM)` = score
logits + APE at `pos % 128`), the per-channel softmax pooling of a completed 128-position
block read through the state block table, the RMSNorm and fp32 RoPE of the pooled row at the
block start's angle, and its commit into the compressed KV pool `cmp_kv`.

Not here: the fixture's tables and RoPE rows (`layers.hca.fixture`), attention over the
committed rows (`layers.hca.layer`), anything distributed. Every step is a module-level function
that `compress` composes.

Order matters (hca.md §10.1): a request's pooling window is read through the state table
*after* its own S writes and *before* any later request's writes. With the fixture's ring
tables a window can hold rows of this step's later positions and, at batches that do not
divide the state pool (31, 63), rows of other requests. `compress` therefore writes the state
request segment by request segment and pools each boundary request as soon as its own rows
are in; "write all, then pool all" gives different results.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..contract.config import HCA_COMPRESS_RATIO, ModelConfig
from .numerics import bf16, f32

COMPRESS_RATIO = HCA_COMPRESS_RATIO


def out_dim(model: ModelConfig) -> int:
    """OUT_DIM = COFF * head_dim with COFF = 1 (no overlap at ratio 128)."""
    return model.head_dim


def state_rows(compress_state: torch.Tensor) -> torch.Tensor:
    """The state pool [NB, SB, 2*OUT_DIM] as flat rows `page * SB + intra` (a view)."""
    return compress_state.view(-1, compress_state.shape[-1])


def project(
    x_normed: torch.Tensor,
    cmp_wkv: torch.Tensor,
    cmp_wgate: torch.Tensor,
    cmp_ape: torch.Tensor,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step A plus the APE add: `(kv_proj, score_proj)` fp32 [T, OUT_DIM].

    `kv = xn @ Wkv^T`, `score = xn @ Wg^T + ape[pos % 128]` (weights stored out x in).
    """
    xn = f32(x_normed)
    kv_proj = xn @ f32(cmp_wkv).t()
    score_proj = xn @ f32(cmp_wgate).t()
    ape_rows = cmp_ape[position_ids.to(torch.int64) % COMPRESS_RATIO]
    return kv_proj, score_proj + ape_rows


def write_state(
    compress_state: torch.Tensor, state_slot_mapping: torch.Tensor, kv_proj: torch.Tensor, score_proj: torch.Tensor
) -> None:
    """Store each token's `(kv, score)` at its `state_slot_mapping` row; -1 writes nothing.

    The rows of one call must be distinct (the fixture's mapping is injective per rank).
    """
    slots = state_slot_mapping.to(torch.int64)
    keep = slots >= 0
    rows = state_rows(compress_state)
    rows.index_copy_(0, slots[keep], torch.cat((kv_proj[keep], score_proj[keep]), dim=-1))


def boundary_requests(position_ids: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests whose chunk completes a 128-position block: `(requests, pool_pos, commit_s)`.

    `pool_pos` is the *last* boundary position of the chunk (the pooled block ends there),
    `commit_s` the chunk slot of the *first* boundary (whose cmp slot receives the row); with
    S <= 128 there is at most one boundary and they coincide (hca.md §10.3).
    """
    pos = position_ids.to(torch.int64).view(-1, seq)
    boundary = (pos + 1) % COMPRESS_RATIO == 0
    requests = torch.nonzero(boundary.any(dim=1)).flatten()
    b = boundary[requests]
    slot = torch.arange(seq, dtype=torch.int64, device=pos.device)
    last_s = torch.where(b, slot, -1).amax(dim=1)
    commit_s = torch.where(b, slot, seq).amin(dim=1)
    return requests, pos[requests, last_s], commit_s


def window_state_rows(
    compress_state_block_table: torch.Tensor, request: int, pool_pos: int, state_block_size: int
) -> torch.Tensor:
    """Flat state rows of positions `pool_pos-127 .. pool_pos` of `request`, int64 [128]; -1 if unmapped."""
    offsets = torch.arange(COMPRESS_RATIO, dtype=torch.int64, device=compress_state_block_table.device)
    q = pool_pos - COMPRESS_RATIO + 1 + offsets
    page = compress_state_block_table[request, q // state_block_size].to(torch.int64)
    return torch.where(page >= 0, page * state_block_size + q % state_block_size, -1)


def pool_window(compress_state: torch.Tensor, window_rows: torch.Tensor) -> torch.Tensor:
    """Per-channel softmax-gated average of the window's kv states, fp32 [OUT_DIM].

    Unmapped rows are (kv 0, score -inf). Never-written rows are the pool's zeros, which
    enter with score 0 and dilute the softmax (hca.md §10.2): that is the reference.
    """
    rows = state_rows(compress_state)
    od = rows.shape[-1] // 2
    mapped = (window_rows >= 0)[:, None]
    gathered = rows[window_rows.clamp_min(0)]
    kv_state = torch.where(mapped, gathered[:, :od], 0.0)
    score_state = torch.where(mapped, gathered[:, od:], float("-inf"))
    # [1, 128, OUT_DIM] softmax over dim 1, as the reference golden evaluates it.
    return (kv_state[None] * score_state[None].softmax(dim=1)).sum(dim=1)[0]


def normalize_pooled(pooled: torch.Tensor, cmp_norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """`f32(norm_w) * (pooled * rsqrt(mean(pooled^2) + eps))`, fp32 [N, HD] (no bf16 rounding)."""
    y = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps)
    return f32(cmp_norm_w) * y


def rope_compressed(
    y: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor, model: ModelConfig
) -> torch.Tensor:
    """Forward interleaved rotation of the last R dims of y [N, HD] in fp32 (no bf16 rounding).

    `cos_half, sin_half` [N, R/2] fp32 are the rows of each block start `128 * (cp // 128)`.
    """
    r = model.qk_rope_head_dim
    e, o = y[:, -r:][:, 0::2], y[:, -r:][:, 1::2]
    rot = torch.stack((e * cos_half - o * sin_half, e * sin_half + o * cos_half), dim=-1).flatten(-2)
    return torch.cat((y[:, :-r], rot), dim=-1)


def commit(cmp_kv: torch.Tensor, cmp_slots: torch.Tensor, y: torch.Tensor) -> None:
    """Write `bf16(y)` to the flat cmp_kv rows `cmp_slots` (-1: no write), the only cmp_kv write."""
    keep = cmp_slots >= 0
    flat = cmp_kv.view(-1, cmp_kv.shape[-1])
    flat.index_copy_(0, cmp_slots[keep], bf16(y[keep]))


def compress(
    model: ModelConfig,
    x_normed: torch.Tensor,
    cmp_wkv: torch.Tensor,
    cmp_wgate: torch.Tensor,
    cmp_ape: torch.Tensor,
    cmp_norm_w: torch.Tensor,
    cmp_freqs_cos: torch.Tensor,
    cmp_freqs_sin: torch.Tensor,
    compress_state: torch.Tensor,
    compress_state_block_table: torch.Tensor,
    cmp_kv: torch.Tensor,
    position_ids: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    cmp_slot_mapping: torch.Tensor,
    *,
    window_rows: Callable = window_state_rows,
    rotate: Callable = rope_compressed,
) -> None:
    """One compressor step; updates `compress_state` and `cmp_kv` in place (hca.md §4.4).

    Tokens are request-major (`t = b*S + s`). `cmp_freqs_*` may carry capacity rows past the
    batch; only the boundary requests' rows are read. `window_rows` and `rotate` are the
    steps that locate a pooling window and rotate the pooled row (an implementation under
    test may swap one to model a kernel's variant).
    """
    seq = model.decode_seq
    sb = model.c128_state_block_size
    kv_proj, score_proj = project(x_normed, cmp_wkv, cmp_wgate, cmp_ape, position_ids)
    requests, pool_pos, commit_s = boundary_requests(position_ids, seq)

    # Sequential over boundary requests (see the module docstring): request b's pooling window
    # sees the rows of requests <= b only. Writing the segment of requests up to and including
    # b at once is the spec's "for b in order: write b's rows; pool b" with the pools of the
    # non-boundary requests (which do nothing) skipped.
    pooled = []
    written = 0
    for b, p in zip(requests.tolist(), pool_pos.tolist()):
        end = (b + 1) * seq
        write_state(compress_state, state_slot_mapping[written:end], kv_proj[written:end], score_proj[written:end])
        written = end
        pooled.append(pool_window(compress_state, window_rows(compress_state_block_table, b, p, sb)))
    write_state(compress_state, state_slot_mapping[written:], kv_proj[written:], score_proj[written:])
    if not pooled:
        return

    y = normalize_pooled(torch.stack(pooled), cmp_norm_w, model.rms_norm_eps)
    y = rotate(y, f32(cmp_freqs_cos[requests]), f32(cmp_freqs_sin[requests]), model)
    cmp_slots = cmp_slot_mapping.to(torch.int64).view(-1, seq)[requests, commit_s]
    commit(cmp_kv, cmp_slots, y)


__all__ = [
    "COMPRESS_RATIO",
    "out_dim",
    "state_rows",
    "project",
    "write_state",
    "boundary_requests",
    "window_state_rows",
    "pool_window",
    "normalize_pooled",
    "rope_compressed",
    "commit",
    "compress",
]
