"""Host-side decode metadata: start sets, positions, block tables, slot mappings, window indices.

Owns the helpers of spec components.md §8.1–§8.10 (the reference's `utils.py`): the canonical
start-position sets of each layer, positions and sequence lengths per request, the default
request-interleaved block table, and the lowering of positions through a per-request table
to physical cache / state rows. Host semantics throughout: a logical page outside the table
or mapped to a negative entry gives −1 (never wraps modulo a page count, unlike the device
builder of §9). Positions are `[B, S]` (request b's tokens in row b), tables `[B, width]`.

The injective re-placement of touched pages (csa.md §6.2, hca.md §5.4) belongs to the layer
fixtures, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tile_starts(pattern: Sequence[int], batch: int) -> list[int]:
    """Order-preserving de-duplication of `pattern`, then request b gets `uniq[b mod len]` (§8.1).

    With `batch < len(uniq)` the set is truncated: the long-context entry is listed first so
    it survives.
    """
    uniq = list(dict.fromkeys(int(p) for p in pattern))
    return [uniq[b % len(uniq)] for b in range(batch)]


def swa_decode_start_set(batch: int, window: int, long_pos: int) -> list[int]:
    """[long_pos, window−1, 31]: long-context wraparound, window boundary, in-window interior."""
    return tile_starts([long_pos, window - 1, 31], batch)


def hca_decode_start_set(batch: int, compress_ratio: int, state_block_size: int, long_pos: int) -> list[int]:
    """[long, R−1, R, 2R−1, SB−1, 10] (hca.md §5.1 lists what each regime exercises)."""
    r = compress_ratio
    return tile_starts([long_pos, r - 1, r, 2 * r - 1, state_block_size - 1, 10], batch)


def csa_decode_start_set(
    batch: int, seq: int, compress_ratio: int, state_block_size: int, cache_tile: int, window: int, long_pos: int
) -> list[int]:
    """[long, 0, (R − min(seq,2)) mod R, R−1, 2R−1, window−1, window, SB·32−1, R·tile−1, 2R·tile−1].

    The `SB·32` entry uses the fixed 32-page width of the reference's state tables
    (csa.md §6.1 lists the regimes).
    """
    r = compress_ratio
    pattern = [
        long_pos,
        0,
        (r - min(seq, 2)) % r,
        r - 1,
        2 * r - 1,
        window - 1,
        window,
        state_block_size * 32 - 1,
        r * cache_tile - 1,
        2 * r * cache_tile - 1,
    ]
    return tile_starts(pattern, batch)


def _starts_i64(starts: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(starts, dtype=torch.int64).reshape(-1)


def position_ids_from_starts(starts: Sequence[int] | torch.Tensor, seq: int) -> torch.Tensor:
    """`pos[b, s] = starts[b] + s`, int32 [B, S] (flatten row-major for `position_ids`)."""
    return (_starts_i64(starts)[:, None] + torch.arange(seq, dtype=torch.int64)).to(torch.int32)


def kv_seq_lens_from_starts(
    starts: Sequence[int] | torch.Tensor, seq: int, commit_tokens: int | None = None
) -> torch.Tensor:
    """`starts[b] + (seq if commit_tokens is None else commit_tokens)`, int32 [B] (§8.2)."""
    if commit_tokens is None:
        commit_tokens = seq
    elif not 0 <= commit_tokens <= seq:
        raise ValueError(f"commit_tokens={commit_tokens} must be in [0, seq={seq}]")
    return (_starts_i64(starts) + commit_tokens).to(torch.int32)


def block_table(batch: int, table_blocks: int, physical_blocks: int | None = None, permuted: bool = False) -> torch.Tensor:
    """Default request-interleaved table, int32 [batch, table_blocks] (§8.3).

    `table[b, c] = (col(c)·batch + b) mod P` with `col(c) = c mod P`, optionally permuted to
    `(7·col + 3) mod P`. Wraps the fixed pool of P pages: see §8.3 for when requests alias.
    """
    p = table_blocks if physical_blocks is None else physical_blocks
    col = torch.arange(table_blocks, dtype=torch.int64) % p
    if permuted and p > 1:
        col = (7 * col + 3) % p
    return ((col[None, :] * batch + torch.arange(batch, dtype=torch.int64)[:, None]) % p).to(torch.int32)


def _rows_through_table(logical_rows: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical rows (int64) of per-request logical rows [B, ...] through `table` [B, width].

    −1 where the row is negative, its page is outside the table, or the entry is negative.
    """
    b = logical_rows.shape[0]
    rows = logical_rows.to(torch.int64)
    page = torch.div(rows, block_size, rounding_mode="floor")
    inside = (rows >= 0) & (page < table.shape[1])
    entry = torch.gather(table.to(torch.int64), 1, page.clamp(0, table.shape[1] - 1).reshape(b, -1)).reshape(rows.shape)
    valid = inside & (entry >= 0)
    return torch.where(valid, entry * block_size + rows % block_size, torch.full_like(rows, -1))


def _check_pair(positions: torch.Tensor, table: torch.Tensor) -> None:
    if positions.dim() != 2 or table.dim() != 2 or positions.shape[0] != table.shape[0]:
        raise ValueError(
            f"expected positions [B, S] and a table [B, width] with the same B; got {tuple(positions.shape)} "
            f"and {tuple(table.shape)}"
        )


def paged_slot_mapping(positions: torch.Tensor, table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical row of each token's position (ori / swa slot mapping), int64 [B, S] (§8.5)."""
    _check_pair(positions, table)
    return _rows_through_table(positions, table, block_size)


def swa_indices_and_lens(
    positions: torch.Tensor, table: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window rows oldest → newest, int32 [B·S, window], and lens int32 [B·S] (§8.6).

    Token at p sees positions `[max(0, p−window+1), p]`; `lens = min(p+1, window)`. An
    unmapped page leaves −1 holes that `lens` still counts (P9); columns ≥ lens are −1.
    """
    _check_pair(positions, table)
    p = positions.to(torch.int64)
    start = (p - window + 1).clamp_min(0)
    lens = p - start + 1
    k = torch.arange(window, dtype=torch.int64)
    q = start[..., None] + k  # [B, S, window]
    rows = _rows_through_table(q, table, block_size)
    rows = torch.where(k < lens[..., None], rows, torch.full_like(rows, -1))
    return rows.reshape(-1, window).to(torch.int32), lens.reshape(-1).to(torch.int32)


def compressed_slot_mapping(
    positions: torch.Tensor, table: torch.Tensor, compress_ratio: int, block_size: int
) -> torch.Tensor:
    """Compressed row committed by each boundary token `(p+1) mod ratio == 0`, else −1; int64 [B, S] (§8.8)."""
    _check_pair(positions, table)
    p = positions.to(torch.int64)
    rows = _rows_through_table(torch.div(p, compress_ratio, rounding_mode="floor"), table, block_size)
    return torch.where((p + 1) % compress_ratio == 0, rows, torch.full_like(rows, -1))


def state_slot_mapping(positions: torch.Tensor, table: torch.Tensor, state_block_size: int) -> torch.Tensor:
    """Compressor-state row of every token (boundary or not), int64 [B, S] (§8.10)."""
    _check_pair(positions, table)
    return _rows_through_table(positions, table, state_block_size)


def cache_row_from_table(table_1d: torch.Tensor, slot: int, block_size: int) -> int:
    """One request's physical row of logical `slot`, −1 if its page is unmapped (§8.4).

    No bounds check: a slot past the table raises IndexError, as in the reference.
    """
    phys = int(table_1d[slot // block_size])
    return -1 if phys < 0 else phys * block_size + slot % block_size


__all__ = [
    "tile_starts",
    "swa_decode_start_set",
    "hca_decode_start_set",
    "csa_decode_start_set",
    "position_ids_from_starts",
    "kv_seq_lens_from_starts",
    "block_table",
    "paged_slot_mapping",
    "swa_indices_and_lens",
    "compressed_slot_mapping",
    "state_slot_mapping",
    "cache_row_from_table",
]
