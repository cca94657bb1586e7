"""Rank r's slice of an HCA CP prefill case (docs/prefill.md §5): the SWA prefill's prompt,
raw-KV history and tables, plus the HCA decode layer's compressor weights, the ratio-128 RoPE
table (an HCA layer rotates Q, KV and its compressed rows with the compressed theta), the
compressor's history and the two pools' block tables.

History (`prefix > 0`), the same logical rows on every rank, each through the rank's own tables:
the compressor state of the last 128 positions before the step (what a pooling window that
straddles the prefix reads) and the compressed rows of every block completed before it.
"""

from __future__ import annotations

import torch

from ..components import rope
from ..components.hca_compressor import COMPRESS_RATIO
from ..contract.case import Case
from ..fixtures import draw
from ..hca import layer as hca_decode
from . import fixture, hca_tables, tables
from .case import PrefillCase

COMPRESSOR_WEIGHTS = ("cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w")
WEIGHTS = (*fixture.WEIGHTS, *COMPRESSOR_WEIGHTS)


def weights(case: PrefillCase) -> dict[str, torch.Tensor]:
    """Every replicated weight (the HCA decode layer's recipe at tp = 1, full O weights
    included) and the ratio-128 RoPE table [max_pos, R]."""
    m = case.model
    held = hca_decode.LAYER.rank_inputs(Case("hca", m, 1, m.decode_seq, case.seed), 0)
    cos, sin = rope.rope_rows(m, torch.arange(m.max_position_embeddings), COMPRESS_RATIO)
    return {**{n: held[n] for n in WEIGHTS}, "freqs_cos": cos, "freqs_sin": sin}


def history_state_rows(case: PrefillCase) -> torch.Tensor:
    """The compressor state [n, 2·HD] of positions max(0, prefix−128) … prefix−1, logical order."""
    n = min(case.prefix, COMPRESS_RATIO)
    return draw.uniform((n, 2 * case.model.head_dim), -0.025, 0.025, case.seed, "prefill_compress_state")


def history_cmp_rows(case: PrefillCase) -> torch.Tensor:
    """The compressed rows [prefix // 128, HD] bf16 of the blocks completed before the step."""
    n = case.prefix // COMPRESS_RATIO
    return draw.uniform((n, case.model.head_dim), -0.05, 0.05, case.seed, "prefill_cmp_kv").to(torch.bfloat16)


def pools(case: PrefillCase, state_table: torch.Tensor, cmp_table: torch.Tensor) -> dict[str, torch.Tensor]:
    """compress_state and cmp_kv before the step, the history written through the given tables."""
    hd, sb = case.model.head_dim, hca_tables.state_block_size(case)
    state = torch.zeros(hca_tables.STATE_PHYSICAL_BLOCKS, sb, 2 * hd)
    first = case.prefix - min(case.prefix, COMPRESS_RATIO)
    rows = hca_tables.state_rows(state_table, torch.arange(first, case.prefix), sb)
    state.view(-1, 2 * hd)[rows] = history_state_rows(case)
    cmp_kv = torch.zeros(hca_tables.CMP_BLOCK_NUM, hca_tables.CMP_STORAGE_BLOCK_SIZE, 1, hd, dtype=torch.bfloat16)
    history = history_cmp_rows(case)
    cmp_kv.view(-1, hd)[hca_tables.cmp_rows(cmp_table, torch.arange(history.shape[0]))] = history
    return {"compress_state": state, "cmp_kv": cmp_kv}


def rank_tables(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """The SWA prefill's tables (its `query_position_ids` under the HCA reference's name
    `query_positions`) and the HCA ones."""
    swa = fixture.rank_tables(case, rank)
    positions, valid = hca_tables.snapshot(case, rank)
    return {
        **{n: t for n, t in swa.items() if n != "query_position_ids"},
        "query_positions": swa["query_position_ids"],
        "segment_tail_positions": hca_tables.segment_tail_positions(case),
        "snapshot_positions": positions,
        "snapshot_valid": valid,
        "final_segment_t": torch.tensor([hca_tables.final_segment(case)], dtype=torch.int32),
        "owner_part_table": hca_tables.owner_part_table(case),
        "compress_state_block_table": hca_tables.state_table(case),
        "cmp_block_table": hca_tables.cmp_table(case),
    }


def rank_inputs(case: PrefillCase, rank: int, w: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Rank's inputs: the SWA prefill's (x_hc of its two segments, the raw-KV history), the
    HCA weights (`w`: already drawn), its tables and the two compressor pools with their history."""
    held = fixture.rank_inputs(case, rank, w or weights(case))
    hca = rank_tables(case, rank)
    swa = {n: t for n, t in held.items() if n != "query_position_ids"}
    return {**swa, **hca, **pools(case, hca["compress_state_block_table"], hca["cmp_block_table"])}


__all__ = ["COMPRESSOR_WEIGHTS", "WEIGHTS", "weights", "history_state_rows", "history_cmp_rows", "pools",
           "rank_tables", "rank_inputs"]
