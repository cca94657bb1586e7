"""Segment ownership and the reference's CP metadata tensors (docs/prefill.md §2).

Zigzag (the reference's): rank r owns segments r (part 0) and 2cp−1−r (part 1), so early and
late segments pair up and every rank attends over the same number of keys. Contiguous (the
replicated-KV variant): rank r owns segments 2r and 2r+1, one contiguous block of the prompt.
Either way a rank's two parts sit rank-major in what the group exchanges (zigzag: the tails,
row block 2·rank + part; contiguous: every projected KV row), and `reverse_index[s]` is the
rank-major block of logical segment s.

The builders here give the reference's metadata tensors (`build_metadata` of
prefill_cp_swa.py, with history and uneven lengths filled in); `key_rows` is this project's
key table, derived from them alone, which takes every in-window key from whichever
segment's tail holds it.
"""

from __future__ import annotations

import torch

from .case import MAX_SEGMENT_TILES, PrefillCase

LOCAL_PARTS = 2


def owner(case: PrefillCase, segment: int) -> tuple[int, int]:
    """(rank, part) that owns logical `segment`."""
    cp = case.cp
    if case.cp_layout == "contiguous":
        return segment // 2, segment % 2
    return (segment, 0) if segment < cp else (2 * cp - 1 - segment, 1)


def owner_segments(case: PrefillCase) -> list[list[int]]:
    """owner_segments[rank][part]: the logical segment that part of rank holds."""
    table = [[-1, -1] for _ in range(case.cp)]
    for s in range(case.num_segments):
        r, p = owner(case, s)
        table[r][p] = s
    return table


def owner_rank_table(case: PrefillCase) -> torch.Tensor:
    return torch.tensor([owner(case, s)[0] for s in range(case.num_segments)], dtype=torch.int32)


def reverse_index(case: PrefillCase) -> torch.Tensor:
    """Rank-major tail block of each logical segment: 2·owner_rank + owner_part."""
    return torch.tensor([2 * r + p for r, p in (owner(case, s) for s in range(case.num_segments))], dtype=torch.int32)


def active_rows(length: int, window: int, tile: int) -> int:
    """Rows of query tile `tile` a segment of `length` fills."""
    return max(0, min(length - tile * window, window))


def tail_start(case: PrefillCase, segment: int) -> int:
    """Global position of the first row of the segment's tail (its last ≤ window rows)."""
    return case.starts[segment] + max(0, case.lengths[segment] - case.window)


def ring_row(case: PrefillCase, position: int) -> int:
    """The KV-cache row of a global position (identity block table, ring of cache_rows)."""
    return position % case.cache_rows


def final_window(case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`final_win_seg_src`, `final_win_row_src`, `final_slot_mapping` [window] int32: row j of
    the final window is tail row `row_src[j]` of segment `seg_src[j]` and lands in cache row
    `final_slot_mapping[j]`; −1 where the window reaches before the step (kept from history)."""
    w = case.window
    seg_src = torch.full((w,), -1, dtype=torch.int32)
    row_src = torch.full((w,), -1, dtype=torch.int32)
    slot = torch.full((w,), -1, dtype=torch.int32)
    end = case.prefix + case.total
    for j in range(w):
        pos = end - w + j
        if pos < case.prefix:
            continue
        s = max(i for i, st in enumerate(case.starts) if st <= pos)
        seg_src[j], row_src[j] = s, pos - tail_start(case, s)
        slot[j] = ring_row(case, pos)
    return seg_src, row_src, slot


def query_positions(case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor]:
    """`query_position_ids` [cp, 2, tiles, w] (0 where inactive) and `active` [cp, 2, tiles]."""
    w, parts = case.window, owner_segments(case)
    pos = torch.zeros(case.cp, LOCAL_PARTS, MAX_SEGMENT_TILES, w, dtype=torch.int32)
    active = torch.zeros(case.cp, LOCAL_PARTS, MAX_SEGMENT_TILES, dtype=torch.int32)
    for r in range(case.cp):
        for p in range(LOCAL_PARTS):
            s = parts[r][p]
            for t in range(MAX_SEGMENT_TILES):
                n = active_rows(case.lengths[s], w, t)
                start = case.starts[s] + t * w
                pos[r, p, t, :n] = torch.arange(start, start + n, dtype=torch.int32)
                active[r, p, t] = n
    return pos, active


def overlay_active_lengths(case: PrefillCase) -> torch.Tensor:
    """The reference's `overlay_active_lengths` [cp, 2, tiles, 2]: per query tile, the rows of
    its predecessor overlay (tile 0: the predecessor segment's tail, none for segment 0;
    tile 1: the segment's own tile 0) and its own active rows."""
    w, parts = case.window, owner_segments(case)
    out = torch.zeros(case.cp, LOCAL_PARTS, MAX_SEGMENT_TILES, 2, dtype=torch.int32)
    for r in range(case.cp):
        for p in range(LOCAL_PARTS):
            s = parts[r][p]
            for t in range(MAX_SEGMENT_TILES):
                pred = (min(w, case.lengths[s - 1]) if s > 0 else 0) if t == 0 else active_rows(case.lengths[s], w, 0)
                out[r, p, t] = torch.tensor([pred, active_rows(case.lengths[s], w, t)])
    return out


def key_rows(query_position_ids: torch.Tensor, overlay_active_lengths: torch.Tensor,
             predecessor_segments: torch.Tensor, segment_starts: torch.Tensor, window: int, cache_rows: int,
             predecessors: str = "all") -> torch.Tensor:
    """One rank's key table [2, tiles, w, WIN] int32 into its staging rows
    `[cache ring (cache_rows) | logical tails (2cp·w) | local kv (2·tiles·w)]`, −1 where no key,
    from the rank's reference tables alone.

    Column c of the query at global position q is key position k = q − WIN + 1 + c (valid:
    k ≥ 0, the query row active). History keys (k < prefix = segment_starts[0]) are ring rows;
    keys of the query's own segment (predecessor + 1) are its local rows; a key of an earlier
    segment j is row k − tail_start(j) of j's tail, where tail_start(j) = max(start_j,
    start_{j+1} − w). `predecessors="first"`: only the immediate predecessor's tail, as the
    reference's tables (keys further back dropped).
    """
    parts, tiles, w = query_position_ids.shape
    starts = segment_starts.long()
    nseg = starts.numel()
    prefix = starts[0]
    tails_base, local_base = cache_rows, cache_rows + nseg * window
    q = query_position_ids.long()[..., None]  # [2, tiles, w, 1]
    k = q - window + 1 + torch.arange(window)  # [2, tiles, w, WIN]
    active = torch.arange(w)[None, None, :] < overlay_active_lengths[..., 1].long()[..., None]  # [2, tiles, w]
    own = (predecessor_segments.long() + 1)[:, None, None, None]  # [2, 1, 1, 1]
    own_start = starts[own]
    seg_of_key = torch.searchsorted(starts, k, right=True) - 1  # −1: history
    next_start = torch.cat((starts[1:], starts[-1:]))  # the last segment's tail is never read
    tail_start = torch.maximum(starts, next_start - window)
    earlier = tails_base + seg_of_key.clamp(min=0) * window + (k - tail_start[seg_of_key.clamp(min=0)])
    if predecessors == "first":
        earlier = torch.where(seg_of_key == own - 1, earlier, -1)
    part_base = local_base + torch.arange(parts)[:, None, None, None] * tiles * w
    rows = torch.where(k >= own_start, part_base + (k - own_start), earlier)
    rows = torch.where(k < prefix, k % cache_rows, rows)
    rows = torch.where((k >= 0) & active[..., None], rows, -1)
    return rows.to(torch.int32)


def gathered_slot_mapping(case: PrefillCase) -> torch.Tensor:
    """The all-gather variant's commit table [cp·2·tiles·WIN] int32: the cache row each row of
    the rank-major gathered KV lands in (the final window's positions), −1 for every other row."""
    w, parts = case.window, owner_segments(case)
    slots = torch.full((case.cp, LOCAL_PARTS, MAX_SEGMENT_TILES * w), -1, dtype=torch.int32)
    end = case.prefix + case.total
    for r in range(case.cp):
        for p in range(LOCAL_PARTS):
            s = parts[r][p]
            pos = case.starts[s] + torch.arange(case.lengths[s])
            final = pos >= end - w
            slots[r, p, : case.lengths[s]] = torch.where(final, pos % case.cache_rows, -1).to(torch.int32)
    return slots.reshape(-1)


def gathered_key_rows(query_position_ids: torch.Tensor, overlay_active_lengths: torch.Tensor,
                      segment_starts: torch.Tensor, reverse_index: torch.Tensor, window: int,
                      cache_rows: int) -> torch.Tensor:
    """The all-gather variant's key table [2, tiles, w, WIN] int32 into the staging rows
    `[cache ring (cache_rows) | gathered kv (cp·2·tiles·w, rank-major)]`, −1 where no key.

    Key position k of the query at q (k = q − WIN + 1 + c, valid: k ≥ 0, the query row active)
    is a ring row below the prefix, else row k − start_s of segment s's block in the gathered
    KV: block reverse_index[s] (2·owner rank + part) of tiles·w rows each. Every in-window
    key of the prompt is there, however short the segments.
    """
    parts, tiles, w = query_position_ids.shape
    starts = segment_starts.long()
    q = query_position_ids.long()[..., None]
    k = q - window + 1 + torch.arange(window)
    active = torch.arange(w)[None, None, :] < overlay_active_lengths[..., 1].long()[..., None]
    seg = (torch.searchsorted(starts, k, right=True) - 1).clamp(min=0)
    rows = cache_rows + reverse_index.long()[seg] * tiles * w + (k - starts[seg])
    rows = torch.where(k < starts[0], k % cache_rows, rows)
    rows = torch.where((k >= 0) & active[..., None], rows, -1)
    return rows.to(torch.int32)


__all__ = ["LOCAL_PARTS", "owner", "owner_segments", "owner_rank_table", "reverse_index", "active_rows",
           "tail_start", "ring_row", "final_window", "query_positions", "overlay_active_lengths", "key_rows",
           "gathered_slot_mapping", "gathered_key_rows"]
