"""The ratio-4 overlapping compressor of the CSA layer with its paged fp32 state (csa.md §4.5, §4.7).

Owns one decode step of a ratio-4 compressor on one rank, shared by the main compressor
(head_dim wide, committing bf16 rows of `cmp_kv`) and the indexer's inner compressor
(index_head_dim wide, whose commit — Hadamard and int8 — lives in `layers.indexer`): the fp32
kv / score projections with the APE on the score, the state writes, the 8-entry pooling
window of a request's first compression boundary (front halves of the previous four
positions, back halves of the current four), the per-channel softmax pool, the RMSNorm and
the fp32 RoPE of the pooled row, and the main commit.

State row layout (width 2·OUT, OUT = 2·dim): `kv front | kv back | score front | score back`.

Order matters (§9 pitfalls 1, 2): requests are processed strictly in order — request b's S
state rows are written, then its window is read, then request b+1 — because the default
state tables alias history rows onto other requests' (and the same request's) current rows.
Only the first boundary of a request (token `3 − first mod 4`) is pooled and committed.

The stages are composed by `layers.csa.layer` (its forward looks them up at call time, so a test
can inject a defect into one stage, e.g. `write_state` or `commit_cmp_rows`).
"""

from __future__ import annotations

import torch

from .numerics import bf16, f32

COMPRESS_RATIO = 4
WINDOW = 2 * COMPRESS_RATIO  # previous + current positions of one compressed slot


def project(
    x_normed: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(kv, score)` fp32 [T, OUT]: `x @ wkvᵀ`, `x @ wgateᵀ + ape[p mod 4]` (APE is stored with the score)."""
    x = f32(x_normed)
    kv = x @ f32(wkv).t()
    score = x @ f32(wgate).t()
    return kv, score + f32(ape)[position_ids.to(torch.int64) % COMPRESS_RATIO]


def write_state(state_rows: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, score: torch.Tensor) -> None:
    """`state_rows[slot] = kv | score` for each token with slot >= 0 (one request's tokens)."""
    keep = slots >= 0
    state_rows[slots[keep]] = torch.cat((kv[keep], score[keep]), dim=-1)


def first_boundary(first: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(boundary_s, commit)` per request: the first token with `(p+1) mod 4 == 0`, if inside the step."""
    boundary = COMPRESS_RATIO - 1 - first % COMPRESS_RATIO
    return boundary, boundary < seq


def window_rows(state_block_table: torch.Tensor, first: torch.Tensor, state_block_size: int) -> torch.Tensor:
    """State rows of the 8 pooled positions `prev..prev+3, cur..cur+3` per request, int64 [B, 8].

    `cur = 4·floor(first/4)`, `prev = cur − 4`; −1 for a negative position or an unmapped page.
    """
    cur = first - first % COMPRESS_RATIO
    a = cur[:, None] - COMPRESS_RATIO + torch.arange(WINDOW, dtype=torch.int64, device=first.device)  # [B, 8]
    page = torch.div(a, state_block_size, rounding_mode="floor").clamp(0, state_block_table.shape[1] - 1)
    entry = torch.gather(state_block_table.to(torch.int64), 1, page)
    ok = (a >= 0) & (a // state_block_size < state_block_table.shape[1]) & (entry >= 0)
    return torch.where(ok, entry * state_block_size + a % state_block_size, torch.full_like(a, -1))


def write_and_gather(
    state_rows: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    score: torch.Tensor,
    windows: torch.Tensor,
) -> torch.Tensor:
    """Write each request's S state rows, then read its window rows: [B, 8, 2·OUT].

    The loop over requests is the semantics (§9 pitfall 2): a window row may alias a row a
    later request writes in this step (it must still see the old value) or one an earlier
    request or the request itself wrote (it must see the new one). Absent rows read as zeros
    (replaced by the pool's kv 0 / score −inf entries).
    """
    b, w = windows.shape
    seq = kv.shape[0] // b
    gathered = state_rows.new_zeros(b, w, state_rows.shape[1])
    for i in range(b):
        tok = slice(i * seq, (i + 1) * seq)
        write_state(state_rows, state_slot_mapping[tok], kv[tok], score[tok])
        gathered[i] = state_rows[windows[i].clamp_min(0)]
    return gathered


def pool(gathered: torch.Tensor, windows: torch.Tensor, dim: int) -> torch.Tensor:
    """Per-channel softmax pool of the 8 window entries: fp32 [B, dim].

    Previous positions contribute their front halves, current positions their back halves;
    an absent entry (position < 0) is kv 0 with a true −inf score.
    """
    out = 2 * dim
    front, back = gathered[:, : COMPRESS_RATIO], gathered[:, COMPRESS_RATIO:]
    kv = torch.cat((front[..., :dim], back[..., dim:out]), dim=1)  # [B, 8, dim]
    score = torch.cat((front[..., out : out + dim], back[..., out + dim :]), dim=1)
    absent = (windows < 0)[..., None]
    kv = kv.masked_fill(absent, 0.0)
    score = score.masked_fill(absent, float("-inf"))
    weights = torch.softmax(score, dim=1)
    return (weights * kv).sum(dim=1)


def rotate_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Forward interleaved rotation of x [B, R] by rows [B, R] (first R/2 columns), in fp32, no rounding."""
    half = x.shape[-1] // 2
    c, s = f32(cos[:, :half]), f32(sin[:, :half])
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2)


def normalize_rotate(
    pooled: torch.Tensor, norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """`y = pooled · rsqrt(mean y² + eps) · norm_w`, last R dims rotated by the rows cos/sin [B, R]; fp32."""
    y = pooled * torch.rsqrt(pooled.pow(2).mean(dim=-1, keepdim=True) + eps) * f32(norm_w)
    r = cos.shape[-1]
    return torch.cat((y[:, :-r], rotate_fp32(y[:, -r:], cos, sin)), dim=-1)


def commit_slots(first: torch.Tensor, slot_mapping: torch.Tensor, seq: int) -> torch.Tensor:
    """The cache row each request commits, int64 [B]: the slot of its first-boundary token.

    −1 where the request has no boundary in the step (S < 4) or the token's slot is −1. The
    second boundary of a request (token `boundary + 4`) is never committed (§9 pitfall 1).
    """
    boundary, commit = first_boundary(first, seq)
    token = torch.arange(first.shape[0], dtype=torch.int64, device=first.device) * seq + boundary.clamp(max=seq - 1)
    slots = slot_mapping.to(torch.int64)[token]
    return torch.where(commit, slots, torch.full_like(slots, -1))


def commit_cmp_rows(cmp_kv: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`cmp_kv[slot] = bf16(row)` for every request with slot >= 0 (the main compressor's commit)."""
    keep = slots >= 0
    cmp_kv.view(-1, cmp_kv.shape[-1])[slots[keep]] = bf16(rows[keep])


__all__ = [
    "project",
    "write_state",
    "first_boundary",
    "window_rows",
    "write_and_gather",
    "pool",
    "rotate_fp32",
    "normalize_rotate",
    "commit_slots",
    "commit_cmp_rows",
]
