"""Rank r's slice of a CSA CP prefill case (docs/prefill.md §12): the SWA prefill's slice, the
CSA weights (the CSA decode layer's recipe), its pools with their history and its tables.

The weights are the SWA prefill's (front and full O weights) and the CSA decode layer's
compressors and indexer, drawn at tp = 1, replicated; RoPE is the ratio-4 table (compressed
theta) for Q, KV, the indexer and the compressed rows, as the reference's. History
(`prefix > 0`): both compressors' state rows of the 8 positions before the step and the
compressed rows (bf16, and int8 with their scale) of the blocks completed before it, the same
logical rows on every rank, each written through the rank's own tables.
"""

from __future__ import annotations

import torch

from ..components import rope
from ..components.csa_compressor import COMPRESS_RATIO
from ..contract.case import Case
from ..csa import fixture as csa_decode
from ..fixtures import draw
from . import csa_tables, fixture
from .case import PrefillCase

COMPRESSOR_WEIGHTS = ("cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "inner_wkv", "inner_wgate", "inner_ape",
                      "inner_norm_w")
INDEXER_WEIGHTS = ("hadamard_idx", "idx_wq_b", "idx_wq_b_scale", "idx_weights_proj")
WEIGHTS = (*fixture.WEIGHTS, *COMPRESSOR_WEIGHTS, *INDEXER_WEIGHTS)
POOLS = ("compress_state", "inner_compress_state", "cmp_kv", "idx_kv_cache", "idx_kv_scale")


def weights(case: PrefillCase) -> dict[str, torch.Tensor]:
    """Every replicated weight and the ratio-4 RoPE table [max_pos, R]."""
    m = case.model
    swa = fixture.weights(case)
    csa = csa_decode.replicated_weights(Case("csa", m, 1, m.decode_seq, case.seed))
    csa = {**csa, "idx_weights_proj": csa["weights_proj"]}  # the prefill reference's name
    cos, sin = rope.rope_rows(m, torch.arange(m.max_position_embeddings), COMPRESS_RATIO)
    return {**{n: swa[n] for n in fixture.WEIGHTS}, **{n: csa[n] for n in (*COMPRESSOR_WEIGHTS, *INDEXER_WEIGHTS)},
            "freqs_cos": cos, "freqs_sin": sin}


def history_positions(case: PrefillCase) -> torch.Tensor:
    """The positions whose compressor states sit in the pools before the step (the last <= 8)."""
    return torch.arange(max(0, case.prefix - csa_tables.STATE_LEN), case.prefix)


def history_states(case: PrefillCase, width: int, which: str) -> torch.Tensor:
    """A compressor's state rows [n, width] of `history_positions`, logical order."""
    n = history_positions(case).numel()
    return draw.uniform((n, width), -0.025, 0.025, case.seed, "prefill_csa_state", which)


def history_compressed(case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressed rows of the blocks completed before the step: `(cmp bf16 [n, HD], idx
    int8 [n, ID], idx_scale fp32 [n, 1])`, n = prefix // 4 (the reference's draws)."""
    m, n = case.model, case.prefix // COMPRESS_RATIO
    cmp = draw.uniform((n, m.head_dim), -0.5, 0.5, case.seed, "prefill_csa_cmp").to(torch.bfloat16)
    idx = draw.uniform((n, m.index_head_dim), -31.5, 31.5, case.seed, "prefill_csa_idx").round().clamp(-31, 31)
    scale = draw.uniform((n, 1), 1e-4, 1.01e-2, case.seed, "prefill_csa_idx_scale")
    return cmp, idx.to(torch.int8), scale


def pools(case: PrefillCase, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The five pools before the step, the history written through the tables of `t`."""
    m = case.model
    hd, idd, sb, cb = m.head_dim, m.index_head_dim, csa_tables.STATE_BLOCK_SIZE, csa_tables.CMP_STORAGE_BLOCK_SIZE
    out = {"compress_state": torch.zeros(csa_tables.STATE_PHYSICAL_BLOCKS, sb, 4 * hd),
           "inner_compress_state": torch.zeros(csa_tables.STATE_PHYSICAL_BLOCKS, sb, 4 * idd),
           "cmp_kv": torch.zeros(csa_tables.CMP_BLOCK_NUM, cb, 1, hd, dtype=torch.bfloat16),
           "idx_kv_cache": torch.zeros(csa_tables.IDX_BLOCK_NUM, cb, 1, idd, dtype=torch.int8),
           "idx_kv_scale": torch.zeros(csa_tables.IDX_BLOCK_NUM, cb, 1, 1)}
    positions = history_positions(case)
    for pool, table, which in (("compress_state", "compress_state_block_table", "main"),
                               ("inner_compress_state", "inner_compress_state_block_table", "inner")):
        width = out[pool].shape[-1]
        out[pool].view(-1, width)[csa_tables.state_rows(t[table], positions)] = history_states(case, width, which)
    cmp, idx, scale = history_compressed(case)
    slots = torch.arange(cmp.shape[0])
    out["cmp_kv"].view(-1, hd)[csa_tables.cmp_rows(t["cmp_block_table"], slots)] = cmp
    idx_rows = csa_tables.cmp_rows(t["idx_block_table"], slots)
    out["idx_kv_cache"].view(-1, idd)[idx_rows] = idx
    out["idx_kv_scale"].view(-1, 1)[idx_rows] = scale
    return out


def rank_tables(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """The SWA prefill's tables (`query_position_ids` under the CSA reference's name
    `query_positions`), the last segment and the four block tables."""
    swa = fixture.rank_tables(case, rank)
    return {
        **{n: t for n, t in swa.items() if n != "query_position_ids"},
        "query_positions": swa["query_position_ids"],
        "final_segment_t": torch.tensor([case.num_segments - 1], dtype=torch.int32),
        "compress_state_block_table": csa_tables.state_table(case),
        "inner_compress_state_block_table": csa_tables.inner_state_table(case),
        "cmp_block_table": csa_tables.cmp_table(case),
        "idx_block_table": csa_tables.idx_table(case),
    }


def rank_inputs(case: PrefillCase, rank: int, w: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Rank's inputs: the SWA prefill's (x_hc of its two segments, the raw-KV history), the CSA
    weights (`w`: already drawn), its tables and the five pools with their history."""
    held = fixture.rank_inputs(case, rank, w or weights(case))
    own = rank_tables(case, rank)
    return {**{n: t for n, t in held.items() if n != "query_position_ids"}, **own, **pools(case, own)}


__all__ = ["COMPRESSOR_WEIGHTS", "INDEXER_WEIGHTS", "WEIGHTS", "POOLS", "weights", "history_positions",
           "history_states", "history_compressed", "pools", "rank_tables", "rank_inputs"]
