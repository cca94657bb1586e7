"""Segment ownership and the reference's CP metadata tensors (docs/prefill.md §2).

Zigzag (the reference's): rank r owns segments r (part 0) and 2cp−1−r (part 1), so early and
late segments pair up and every rank attends over the same number of keys. Contiguous (the
replicated-KV variant): rank r owns segments 2r and 2r+1. Either way a rank's two tails sit
rank-major in the exchange window (row block 2·rank + part), and `reverse_index[s]` is the
rank-major block of logical segment s.

`reference_metadata` builds the reference's tensors (`build_metadata` of prefill_cp_swa.py,
with history and uneven lengths filled in); `key_rows` is this project's key table, which
takes every in-window key from whichever segment's tail holds it.
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


def key_rows(case: PrefillCase, rank: int, predecessors: str = "all") -> torch.Tensor:
    """Rank's key table [2, tiles, w, WIN] int32 into its staging rows
    `[cache ring (cache_rows) | logical tails (2cp·w) | local kv (2·tiles·w)]`, −1 where no key.

    Column c of query q (global position) is key position q − WIN + 1 + c (valid: ≥ 0).
    History keys (< prefix) are ring rows; keys of the query's own segment are local rows;
    keys of an earlier segment are rows of its tail. `predecessors="first"`: only the
    immediate predecessor's tail, as the reference's tables (keys further back dropped).
    """
    w, nseg, parts = case.window, case.num_segments, owner_segments(case)
    tails_base = case.cache_rows
    local_base = tails_base + nseg * w
    starts, lens = case.starts, case.lengths
    rows = torch.full((LOCAL_PARTS, MAX_SEGMENT_TILES, w, w), -1, dtype=torch.int32)
    for p in range(LOCAL_PARTS):
        s = parts[rank][p]
        for t in range(MAX_SEGMENT_TILES):
            for i in range(active_rows(lens[s], w, t)):
                q = starts[s] + t * w + i
                for c in range(w):
                    k = q - w + 1 + c
                    if k < 0:
                        continue
                    if k < case.prefix:
                        rows[p, t, i, c] = ring_row(case, k)
                    elif k >= starts[s]:
                        rows[p, t, i, c] = local_base + (p * MAX_SEGMENT_TILES) * w + (k - starts[s])
                    else:
                        ks = max(j for j in range(s) if starts[j] <= k)
                        if predecessors == "first" and ks != s - 1:
                            continue
                        rows[p, t, i, c] = tails_base + ks * w + (k - tail_start(case, ks))
    return rows


__all__ = ["LOCAL_PARTS", "owner", "owner_segments", "owner_rank_table", "reverse_index", "active_rows",
           "tail_start", "ring_row", "final_window", "query_positions", "key_rows"]
