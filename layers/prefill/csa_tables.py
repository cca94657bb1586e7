"""The CSA CP prefill's pools and tables beside the SWA ones (docs/prefill.md §12; the
reference's prefill_cp_csa.py `_build_block_tables` and `_build_metadata_tensors`, with
history and uneven lengths filled in).

Five pools besides the raw-KV ring, each addressed through its own block table per rank:
- `compress_state` [65, 4, 4·HD] and `inner_compress_state` [65, 4, 4·ID] fp32: the main and
  the indexer's inner ratio-4 compressor's per-position rows (kv front | kv back | score front
  | score back); position p lives at row `table[p // 4]·4 + p % 4`. The reference's tables
  are `b mod 65` for both; ours give the inner pool another bijection, (7·b + 5) mod 65, so
  a row written through the wrong pool's table lands elsewhere.
- `cmp_kv` [32, 32, 1, HD] bf16 and `idx_kv_cache` [64, 32, 1, ID] int8 with `idx_kv_scale`
  [64, 32, 1, 1] fp32: one row per 4 positions; logical slot c (positions 4c … 4c+3) lives at
  row `table[c // 32]·32 + c % 32` (a 128-position page holds 32 compressed rows), the
  tables `c mod 32` and `c mod 64` (rings).
"""

from __future__ import annotations

import torch

from ..components.csa_compressor import COMPRESS_RATIO, WINDOW as STATE_LEN
from ..contract.config import ConfigError
from .case import PREFILL_BLOCK_ROWS, PrefillCase

STATE_BLOCK_SIZE = 4  # the reference's MAIN_STATE_BLOCK_SIZE / INNER_STATE_BLOCK_SIZE
STATE_PHYSICAL_BLOCKS = 65  # CSA_STATE_PHYSICAL_BLOCKS / CSA_INNER_STATE_PHYSICAL_BLOCKS
CMP_STORAGE_BLOCK_SIZE = PREFILL_BLOCK_ROWS // COMPRESS_RATIO  # compressed rows per 128-position page
CMP_BLOCK_NUM = 32  # PREFILL_CMP_BLOCK_NUM
IDX_BLOCK_NUM = 64  # PREFILL_IDX_BLOCK_NUM
CANDIDATE_CAPACITY = 1024  # CP_CANDIDATE_CAPACITY: compressed rows the indexer scores at most
SELECTED_WIDTH = 256  # SPARSE_SELECTED_WIDTH: compressed rows a query attends to at most
ROWS_PER_SEGMENT = 2 * PREFILL_BLOCK_ROWS // COMPRESS_RATIO  # a segment of <= 256 rows: <= 64 boundaries
META_DIM = 8  # the reference's META_DIM / STATE_META_DIM


def selected_width(index_topk: int) -> int:
    """Compressed rows a query keeps: the model's top-k, at most the reference's 256."""
    return min(index_topk, SELECTED_WIDTH)


def validate(case: PrefillCase) -> None:
    """The CSA prefill's rules for a case, whatever its scope: a tail long enough for a
    compressor window, no more compressed rows than the indexer scores."""
    if case.window < STATE_LEN:
        raise ConfigError(f"layer=csa phase=prefill needs sliding_window >= {STATE_LEN} (a segment's tail must hold "
                          f"every row a compressor window reaches back to); model {case.model.name!r} has "
                          f"{case.window}")
    slots = (case.prefix + case.total) // COMPRESS_RATIO
    if slots > CANDIDATE_CAPACITY:
        raise ConfigError(f"prefix + prompt = {case.prefix + case.total} completes {slots} compressed rows; the "
                          f"indexer scores at most {CANDIDATE_CAPACITY} (the reference's CP_CANDIDATE_CAPACITY): "
                          f"keep it <= {CANDIDATE_CAPACITY * COMPRESS_RATIO + COMPRESS_RATIO - 1} positions")


def _blocks(case: PrefillCase, size: int) -> torch.Tensor:
    return torch.arange(-(-case.model.max_position_embeddings // size))


def state_table(case: PrefillCase) -> torch.Tensor:
    """`compress_state_block_table` [max_pos / 4] int32: b mod 65 (the reference's)."""
    return (_blocks(case, STATE_BLOCK_SIZE) % STATE_PHYSICAL_BLOCKS).to(torch.int32)


def inner_state_table(case: PrefillCase) -> torch.Tensor:
    """`inner_compress_state_block_table` [max_pos / 4] int32: (7·b + 5) mod 65."""
    return ((_blocks(case, STATE_BLOCK_SIZE) * 7 + 5) % STATE_PHYSICAL_BLOCKS).to(torch.int32)


def cmp_table(case: PrefillCase) -> torch.Tensor:
    """`cmp_block_table` [max_pos / 128] int32: page c mod 32."""
    return (_blocks(case, PREFILL_BLOCK_ROWS) % CMP_BLOCK_NUM).to(torch.int32)


def idx_table(case: PrefillCase) -> torch.Tensor:
    """`idx_block_table` [max_pos / 128] int32: page c mod 64."""
    return (_blocks(case, PREFILL_BLOCK_ROWS) % IDX_BLOCK_NUM).to(torch.int32)


def paged_rows(table: torch.Tensor, logical: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool rows of logical rows (positions or compressed slots) through a block table,
    int64; −1 stays −1."""
    u = logical.long()
    rows = table.long()[u.clamp(min=0) // block_size] * block_size + u.clamp(min=0) % block_size
    return torch.where(u >= 0, rows, -1)


def state_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return paged_rows(table, positions, STATE_BLOCK_SIZE)


def cmp_rows(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of cmp_kv (or of the idx pools) of logical compressed slots."""
    return paged_rows(table, slots, CMP_STORAGE_BLOCK_SIZE)


def boundaries(start: int, end: int) -> list[int]:
    """Positions in [start, end) that complete a compressed row (b + 1 ≡ 0 mod 4)."""
    return list(range(start + (-start - 1) % COMPRESS_RATIO, end, COMPRESS_RATIO))


def state_first(start: int) -> int:
    """The first position a block ending at or after `start` pools: the previous block's start
    (the reference's seed: start mod 4 + 4 rows before the segment), never before 0."""
    return max(0, start - start % COMPRESS_RATIO - COMPRESS_RATIO)


def final_state_positions(case: PrefillCase) -> tuple[int, int]:
    """(first, count): the positions whose compressor states the step leaves for decode, the
    last <= 8 of the step (never history: those rows are already in the pools)."""
    end = case.prefix + case.total
    first = max(case.prefix, end - STATE_LEN)
    return first, end - first


__all__ = ["STATE_LEN", "STATE_BLOCK_SIZE", "STATE_PHYSICAL_BLOCKS", "CMP_STORAGE_BLOCK_SIZE", "CMP_BLOCK_NUM",
           "IDX_BLOCK_NUM", "CANDIDATE_CAPACITY", "SELECTED_WIDTH", "ROWS_PER_SEGMENT", "META_DIM", "selected_width",
           "validate", "state_table", "inner_state_table", "cmp_table", "idx_table", "paged_rows", "state_rows",
           "cmp_rows", "boundaries", "state_first", "final_state_positions"]
