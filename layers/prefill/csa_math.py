"""The CSA prefill's compressor and indexer math, shared by the whole-prompt golden and the
stage list (prefill_cp_csa.py's golden, built from the decode components).

Compressors: every position's main and inner (kv, score + APE) rows from its normed hidden
row; a block ending at b (b + 1 ≡ 0 mod 4) pools positions b−7 … b (front halves of the
previous four, back halves of its own four), RMSNorm, RoPE at b−3: the main row bf16, the
inner row Hadamard-rotated and int8 per row with its fp32 scale.
Indexer: each query's int8 heads (RoPE at its own position; the no-RoPE part stays fp32 up to
the Hadamard, as the reference's prefill golden), scored against the visible int8 rows
(`(q·k)·q_scale·k_scale`, relu, weighted head sum), the top min(top-k, 256) kept.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..components import csa_compressor as comp
from ..components import indexer, rope
from ..components.numerics import bf16, f32, int8_matmul, int8_quant_per_row
from ..contract.config import ModelConfig
from . import csa_tables

MAIN, INNER = "cmp", "inner"  # the weight prefixes of the two compressors
_SCORE_ROWS = 128  # query rows scored at a time (bounds the [rows, heads, candidates] product)


def states(normed: torch.Tensor, positions: torch.Tensor, w: Mapping[str, torch.Tensor],
           which: str) -> torch.Tensor:
    """The compressor `which`'s state rows fp32 [N, 2·OUT] (kv | score + APE) of normed [N, D]."""
    kv, score = comp.project(normed, w[f"{which}_wkv"], w[f"{which}_wgate"], w[f"{which}_ape"], positions)
    return torch.cat((kv, score), dim=-1)


def pooled_rows(model: ModelConfig, w: Mapping[str, torch.Tensor], rows: torch.Tensor, first: int,
                ends: torch.Tensor, which: str) -> torch.Tensor:
    """Pooled, normalized, rotated rows fp32 [len(ends), dim] of the blocks ending at `ends`;
    rows [n, 2·OUT] hold positions first … first + n − 1."""
    window = ends[:, None] - comp.WINDOW + 1 + torch.arange(comp.WINDOW)  # positions [B, 8]
    gathered = rows[(window - first).clamp(min=0)]
    flags = torch.where(window >= 0, window, -1)
    pooled = comp.pool(gathered, flags, rows.shape[-1] // 4)
    at = ends - comp.COMPRESS_RATIO + 1
    return comp.normalize_rotate(pooled, w[f"{which}_norm_w"], w["freqs_cos"][at], w["freqs_sin"][at],
                                 model.rms_norm_eps)


def compress(model: ModelConfig, w: Mapping[str, torch.Tensor], main: torch.Tensor, inner: torch.Tensor,
             first: int, ends: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed rows of the blocks ending at `ends`: `(cmp bf16 [n, HD], idx int8 [n, ID],
    idx_scale fp32 [n, 1])`, from both compressors' rows of positions first …"""
    n = len(ends)
    ends_t = torch.tensor(ends, dtype=torch.int64)
    idx = torch.zeros(n, 1, 1, model.index_head_dim, dtype=torch.int8)
    scale = torch.zeros(n, 1, 1, 1)
    if not n:
        return torch.zeros(0, model.head_dim, dtype=torch.bfloat16), idx.view(0, model.index_head_dim), scale.view(0, 1)
    cmp = bf16(pooled_rows(model, w, main, first, ends_t, MAIN))
    indexer.commit_idx_rows(idx, scale, torch.arange(n), pooled_rows(model, w, inner, first, ends_t, INNER),
                            w["hadamard_idx"])
    return cmp, idx.view(n, model.index_head_dim), scale.view(n, 1)


def query(model: ModelConfig, w: Mapping[str, torch.Tensor], qr: torch.Tensor, qr_scale: torch.Tensor,
          normed: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's `(q int8 [N, IH, ID], q_scale fp32 [N, IH, 1], head weights fp32 [N, IH])`."""
    n, ih, idd, nope = qr.shape[0], model.index_n_heads, model.index_head_dim, model.index_nope_head_dim
    qi = ((int8_matmul(qr, w["idx_wq_b"]) * f32(qr_scale)) * f32(w["idx_wq_b_scale"])).reshape(n, ih, idd)
    pos = positions.long()
    rotated = f32(rope.apply_rope(qi[..., nope:], w["freqs_cos"][pos], w["freqs_sin"][pos]))
    q, q_scale = int8_quant_per_row(torch.cat((qi[..., :nope], rotated), dim=-1) @ f32(w["hadamard_idx"]))
    return q, q_scale, indexer.head_weights(model, normed, w["idx_weights_proj"])


def visible(positions: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Compressed rows each query may select, int64 [N]: (q + 1) // 4 (capped), 0 if inactive."""
    causal = ((positions.long() + 1) // comp.COMPRESS_RATIO).clamp(max=csa_tables.CANDIDATE_CAPACITY)
    return torch.where(active, causal, 0)


def select(model: ModelConfig, q: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor,
           idx_rows: torch.Tensor, idx_scale: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """`cmp_indices` int32 [N, K]: each query's top K = min(top-k, 256) logical slots among
    its `seen` first candidates idx_rows [C, ID] int8 / idx_scale [C] (−1 past them)."""
    n, ih, _ = q.shape
    c = idx_rows.shape[0]
    score = torch.zeros(n, c)
    keys = idx_rows.t()
    for r in range(0, n if c else 0, _SCORE_ROWS):
        part = slice(r, r + _SCORE_ROWS)
        dots = int8_matmul(q[part].reshape(-1, q.shape[-1]), keys).view(-1, ih, c)
        s = dots * f32(q_scale[part]) * f32(idx_scale).view(1, 1, c)
        score[part] = (s.relu() * f32(weights[part])[..., None]).sum(dim=1)
    return indexer.select_topk(score, seen, csa_tables.selected_width(model.index_topk))


__all__ = ["MAIN", "INNER", "states", "pooled_rows", "compress", "query", "visible", "select"]
