"""The HCA CP prefill's pools and tables beside the SWA ones (docs/prefill.md §5; the
reference's prefill_cp_hca.py `build_hca_metadata`, with history and uneven lengths filled in).

Two pools besides the raw-KV ring, each addressed through its own block table (a rank's
tables may differ; the reference's are the same on every rank):
- `compress_state` [STATE_PHYSICAL_BLOCKS, SB, 2·HD] fp32: the compressor's per-position
  (kv, score + APE) rows; position p lives at row `table[p // SB]·SB + p % SB`. The reference's
  state table is deliberately non-identity: logical block b -> physical (17·b + 3) mod 64.
- `cmp_kv` [CMP_BLOCK_NUM, 1, 1, HD] bf16: one compressed row per 128 positions; logical slot
  c (positions 128c … 128c+127) lives at row `cmp_block_table[c]` (storage blocks of one row:
  the reference's 128-row page over a ratio of 128), a ring of 32 rows.
"""

from __future__ import annotations

import torch

from ..components.hca_compressor import COMPRESS_RATIO
from ..contract.config import ConfigError
from . import tables
from .case import PrefillCase

STATE_PHYSICAL_BLOCKS = 64  # the reference's HCA_STATE_PHYSICAL_BLOCKS
CMP_BLOCK_NUM = 32  # the reference's PREFILL_CMP_BLOCK_NUM: the compressed-row pool
CMP_STORAGE_BLOCK_SIZE = 1  # BLOCK_SIZE // COMPRESS_RATIO: rows per cmp page
CMP_ROWS_PER_SEGMENT = 2  # a segment of ≤ 256 rows completes at most two 128-position blocks
META_DIM = 8  # the reference's CMP_META_DIM / STATE_META_DIM


def check_case(case: PrefillCase) -> None:
    """What an HCA prefill case needs beyond the CP rules: a window of the compress ratio (a
    segment's tail must hold every row a pooling window reaches back to) and a prompt whose
    compressed rows fit the ring without overwriting rows a query still reads."""
    if case.window != COMPRESS_RATIO:
        raise ConfigError(f"layer=hca phase=prefill needs sliding_window = {COMPRESS_RATIO} (the compress "
                          f"ratio: a segment's tail must hold every row a pooling window reaches back to); "
                          f"model {case.model.name!r} has {case.window}")
    slots = (case.prefix + case.total) // COMPRESS_RATIO
    capacity = CMP_BLOCK_NUM * CMP_STORAGE_BLOCK_SIZE
    if slots > capacity:
        raise ConfigError(f"prefix + prompt = {case.prefix + case.total} completes {slots} compressed rows; the "
                          f"compressed pool is a ring of {capacity} (the reference's): keep it <= "
                          f"{capacity * COMPRESS_RATIO + COMPRESS_RATIO - 1} positions")


def state_block_size(case: PrefillCase) -> int:
    return case.model.c128_state_block_size


def state_table(case: PrefillCase) -> torch.Tensor:
    """`compress_state_block_table` [ceil(max_pos / SB)] int32: (17·b + 3) mod 64."""
    blocks = -(-case.model.max_position_embeddings // state_block_size(case))
    return ((torch.arange(blocks) * 17 + 3) % STATE_PHYSICAL_BLOCKS).to(torch.int32)


def cmp_table(case: PrefillCase) -> torch.Tensor:
    """`cmp_block_table` [ceil(max_pos / 128)] int32: logical slot c -> c mod 32 (the ring)."""
    slots = -(-case.model.max_position_embeddings // COMPRESS_RATIO)
    return (torch.arange(slots) % CMP_BLOCK_NUM).to(torch.int32)


def state_rows(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat compress_state rows of `positions` through `table`, int64 (−1: negative position)."""
    pos = positions.long()
    rows = table.long()[pos.clamp(min=0) // block_size] * block_size + pos.clamp(min=0) % block_size
    return torch.where(pos >= 0, rows, -1)


def cmp_rows(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Flat cmp_kv rows of logical `slots` through `table`, int64 (−1 stays −1)."""
    s = slots.long()
    rows = table.long()[s.clamp(min=0) // CMP_STORAGE_BLOCK_SIZE] * CMP_STORAGE_BLOCK_SIZE
    return torch.where(s >= 0, rows + s.clamp(min=0) % CMP_STORAGE_BLOCK_SIZE, -1)


def boundaries(start: int, end: int) -> list[int]:
    """Positions in [start, end) that complete a 128-position block (its compressed row's end)."""
    return [b for b in range(start, end) if (b + 1) % COMPRESS_RATIO == 0]


def final_state_positions(case: PrefillCase) -> tuple[int, int]:
    """(first, count): the positions whose compressor state the step leaves for decode, the
    last ≤ 128 of the step (never history: those rows are already in the pool)."""
    end = case.prefix + case.total
    first = max(case.prefix, end - COMPRESS_RATIO)
    return first, end - first


def final_segment(case: PrefillCase) -> int:
    return case.num_segments - 1


def segment_tail_positions(case: PrefillCase) -> torch.Tensor:
    """`segment_tail_positions` [2cp, WIN] int32: the positions of each segment's tail rows (−1 past them)."""
    out = torch.full((case.num_segments, case.window), -1, dtype=torch.int32)
    for s in range(case.num_segments):
        first = tables.tail_start(case, s)
        n = case.starts[s] + case.lengths[s] - first
        out[s, :n] = torch.arange(first, first + n, dtype=torch.int32)
    return out


def snapshot(case: PrefillCase, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`snapshot_positions` [2, WIN] and `snapshot_valid` [2] int32 of rank: per part, the last
    ≤ 128 positions up to its segment's end, from the step's first position on (the reference
    reaches back to position 0, which is the same without history)."""
    positions = torch.full((tables.LOCAL_PARTS, case.window), -1, dtype=torch.int32)
    valid = torch.zeros(tables.LOCAL_PARTS, dtype=torch.int32)
    for p, s in enumerate(tables.owner_segments(case)[rank]):
        end = case.starts[s] + case.lengths[s]
        first = max(case.prefix, end - COMPRESS_RATIO)
        positions[p, : end - first] = torch.arange(first, end, dtype=torch.int32)
        valid[p] = end - first
    return positions, valid


def owner_part_table(case: PrefillCase) -> torch.Tensor:
    return torch.tensor([tables.owner(case, s)[1] for s in range(case.num_segments)], dtype=torch.int32)


__all__ = ["STATE_PHYSICAL_BLOCKS", "CMP_BLOCK_NUM", "CMP_STORAGE_BLOCK_SIZE", "CMP_ROWS_PER_SEGMENT", "META_DIM",
           "check_case", "state_block_size", "state_table", "cmp_table", "state_rows", "cmp_rows", "boundaries",
           "final_state_positions", "final_segment", "segment_tail_positions", "snapshot", "owner_part_table"]
