"""Host metadata helpers (components.md §8.1–§8.10) against the spec's worked examples,
loop-based re-statements of the formulas, and the reference snapshots' metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layers.components import metadata as md

from layers.contract.config import MINI

from ..conftest import reference_snapshot

# Requests per rank in the shipped reference snapshots (local_t=32 of MINI's decode_seq=8).
BATCH = 4


# -- naive re-statements (one token / one entry at a time) ---------------------------------


def naive_row(table: list[list[int]], b: int, row: int, bs: int) -> int:
    page = row // bs
    if row < 0 or page >= len(table[b]) or table[b][page] < 0:
        return -1
    return table[b][page] * bs + row % bs


def naive_block_table(batch: int, cols: int, phys: int, permuted: bool) -> list[list[int]]:
    out = []
    for b in range(batch):
        row = []
        for c in range(cols):
            col = c % phys
            if permuted and phys > 1:
                col = (7 * col + 3) % phys
            row.append((col * batch + b) % phys)
        out.append(row)
    return out


# -- start sets, positions, lengths (§8.1, §8.2) -------------------------------------------


def test_start_set_examples():
    assert md.swa_decode_start_set(8, 128, 8192) == [8192, 127, 31, 8192, 127, 31, 8192, 127]
    assert md.csa_decode_start_set(12, 8, 4, 2, 64, 128, 8192) == [8192, 0, 2, 3, 7, 127, 128, 63, 255, 511, 8192, 0]
    assert md.hca_decode_start_set(7, 128, 8, 8192) == [8192, 127, 128, 255, 7, 10, 8192]


def test_start_sets_dedup_and_truncate():
    # seq = 1: (R - 1) mod R duplicates R - 1 and is dropped, leaving 9 regimes.
    s = md.csa_decode_start_set(9, 1, 4, 2, 64, 128, 8192)
    assert s == [8192, 0, 3, 7, 127, 128, 63, 255, 511]
    assert md.csa_decode_start_set(10, 1, 4, 2, 64, 128, 8192)[9] == 8192
    # batch 8 (local_t 64) loses the 255 and 511 regimes; the long context survives.
    assert md.csa_decode_start_set(8, 8, 4, 2, 64, 128, 8192) == [8192, 0, 2, 3, 7, 127, 128, 63]
    assert md.tile_starts([5, 5, 1, 5, 2], 5) == [5, 1, 2, 5, 1]
    assert md.tile_starts([9, 4], 1) == [9]


def test_positions_and_kv_seq_lens():
    pos = md.position_ids_from_starts([0, 5], 4)
    assert pos.dtype == torch.int32 and pos.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]
    assert md.position_ids_from_starts(torch.tensor([1048568]), 8).tolist() == [list(range(1048568, 1048576))]
    lens = md.kv_seq_lens_from_starts([0, 5], 4)
    assert lens.dtype == torch.int32 and lens.tolist() == [4, 9]
    assert md.kv_seq_lens_from_starts([0, 5], 4, commit_tokens=1).tolist() == [1, 6]
    assert md.kv_seq_lens_from_starts([0, 5], 4, commit_tokens=0).tolist() == [0, 5]
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="commit_tokens"):
            md.kv_seq_lens_from_starts([0, 5], 4, commit_tokens=bad)


# -- block tables (§8.3) -------------------------------------------------------------------


def test_block_table_examples():
    t = md.block_table(4, 10, 16)
    assert t.dtype == torch.int32 and t.shape == (4, 10)
    assert t[0].tolist() == [0, 4, 8, 12, 0, 4, 8, 12, 0, 4]
    assert t[3].tolist() == [3, 7, 11, 15, 3, 7, 11, 15, 3, 7]
    assert md.block_table(4, 10, 16, permuted=True)[0].tolist() == [12, 8, 4, 0, 12, 8, 4, 0, 12, 8]
    aliased = md.block_table(batch=3, table_blocks=6, physical_blocks=8)
    assert aliased.tolist() == [[0, 3, 6, 1, 4, 7], [1, 4, 7, 2, 5, 0], [2, 5, 0, 3, 6, 1]]
    assert aliased[0, 3] == aliased[1, 0] == 1  # cross-request aliasing when batch ∤ P
    assert md.block_table(3, 5).tolist() == naive_block_table(3, 5, 5, False)  # P defaults to the width


@pytest.mark.parametrize("batch,cols,phys,permuted", [(5, 70, 64, False), (5, 70, 64, True), (31, 40, 256, False), (2, 9, 1, True)])
def test_block_table_matches_naive(batch, cols, phys, permuted):
    assert md.block_table(batch, cols, phys, permuted).tolist() == naive_block_table(batch, cols, phys, permuted)


def test_block_table_properties():
    # No wrap when batch * table_blocks <= P: all entries distinct.
    assert md.block_table(8, 32, 256).unique().numel() == 256
    # The SWA table: 32768 columns over 512 pages; at batch 16 each request owns 32 pages.
    t = md.block_table(16, 32768, 512)
    assert t.shape == (16, 32768)
    assert all(t[b].unique().numel() == 32 for b in range(16))
    cols = torch.tensor([0, 1, 31, 32, 511, 512, 20001, 32767])
    assert t[:, cols].tolist() == [[((c % 512) * 16 + b) % 512 for c in cols.tolist()] for b in range(16)]


# -- slot mappings and window indices (§8.4–§8.10) -----------------------------------------


def test_worked_example_8_10():
    starts = [0, 5]
    pos = md.position_ids_from_starts(starts, 4)
    table = md.block_table(batch=2, table_blocks=3, physical_blocks=8)
    assert table.tolist() == [[0, 2, 4], [1, 3, 5]]
    slot = md.paged_slot_mapping(pos, table, 4)
    assert slot.dtype == torch.int64 and slot.tolist() == [[0, 1, 2, 3], [13, 14, 15, 20]]
    idx, lens = md.swa_indices_and_lens(pos, table, 4, 4)
    assert idx.dtype == torch.int32 and lens.dtype == torch.int32
    assert idx.tolist() == [
        [0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3],
        [6, 7, 12, 13], [7, 12, 13, 14], [12, 13, 14, 15], [13, 14, 15, 20],
    ]
    assert lens.tolist() == [1, 2, 3, 4, 4, 4, 4, 4]
    assert md.compressed_slot_mapping(pos, table, 2, 4).tolist() == [[-1, 0, -1, 1], [6, -1, 7, -1]]
    assert md.state_slot_mapping(pos, table, 2).tolist() == [[0, 1, 4, 5], [11, -1, -1, -1]]
    holed = table.clone()
    holed[1, 1] = -1
    assert md.paged_slot_mapping(pos, holed, 4).tolist() == [[0, 1, 2, 3], [-1, -1, -1, 20]]
    idx, lens = md.swa_indices_and_lens(pos, holed, 4, 4)
    assert idx[6].tolist() == [-1, -1, -1, -1] and lens[6] == 4  # holes are counted (P9)


def test_mappings_match_naive():
    gen = torch.Generator().manual_seed(3)
    batch, seq, width = 3, 5, 6
    table = torch.randint(-1, 40, (batch, width), generator=gen, dtype=torch.int32)
    table[:, 0] = torch.tensor([7, -1, 2], dtype=torch.int32)
    starts = [0, 20, 40]  # the last request runs past a 6-page table at bs = 8
    pos = md.position_ids_from_starts(starts, seq)
    tl, pl = table.tolist(), pos.tolist()
    for bs in (4, 8):
        want = [[naive_row(tl, b, p, bs) for p in pl[b]] for b in range(batch)]
        assert md.paged_slot_mapping(pos, table, bs).tolist() == want
        assert md.state_slot_mapping(pos, table, bs).tolist() == want
        for ratio in (2, 4):
            want_c = [[naive_row(tl, b, p // ratio, bs) if (p + 1) % ratio == 0 else -1 for p in pl[b]] for b in range(batch)]
            assert md.compressed_slot_mapping(pos, table, ratio, bs).tolist() == want_c
        for window in (3, 16):
            idx, lens = md.swa_indices_and_lens(pos, table, bs, window)
            for b in range(batch):
                for s, p in enumerate(pl[b]):
                    start = max(0, p - window + 1)
                    n = p - start + 1
                    row = [naive_row(tl, b, start + k, bs) if k < n else -1 for k in range(window)]
                    assert idx[b * seq + s].tolist() == row and lens[b * seq + s] == n


def test_cache_row_from_table():
    table = torch.tensor([3, -1, 5], dtype=torch.int32)
    assert md.cache_row_from_table(table, 2, 4) == 3 * 4 + 2
    assert md.cache_row_from_table(table, 5, 4) == -1
    assert md.cache_row_from_table(table, 11, 4) == 5 * 4 + 3
    with pytest.raises(IndexError):
        md.cache_row_from_table(table, 12, 4)


def test_decode_metadata_request0_host_values():
    """§9.2 request 0 (counts [2,3,4,5,6,7]) where the host helpers agree with the device builder.

    The device builder wraps pages modulo the owned count; the host helpers return −1 past the
    table instead (P11), so only the entries whose pages lie inside the table are compared,
    and the CSA state positions past the 4096-page table are −1 on the host.
    """
    positions = torch.tensor([[126, 127, 3, 4, 8191, 8192, 16382, 16383]], dtype=torch.int32)
    counts = [2, 3, 4, 5, 6, 7]

    def cyclic(g, width):
        ids = 1000 * (g + 1) + torch.arange(counts[g], dtype=torch.int32)
        return ids.repeat(width // counts[g] + 1)[:width][None]

    def prefix(g, width):
        t = torch.zeros(1, width, dtype=torch.int32)
        t[0, : counts[g]] = 1000 * (g + 1) + torch.arange(counts[g], dtype=torch.int32)
        return t

    ori = cyclic(0, 512)
    slot = md.paged_slot_mapping(positions, ori, 32)
    assert slot[0].tolist() == [32062, 32063, 32003, 32004, 32063, 32000, 32062, 32063]
    idx, lens = md.swa_indices_and_lens(positions, ori, 32, 128)
    assert lens.tolist() == [127, 128, 4, 5, 128, 128, 128, 128]
    ring = list(range(32000, 32064))
    assert idx[0].tolist() == ring + ring[:63] + [-1]
    assert md.state_slot_mapping(positions, cyclic(3, 2048), 8)[0].tolist() == [32006, 32007, 32003, 32004, 32031, 32032, 32022, 32023]
    assert md.state_slot_mapping(positions, cyclic(4, 4096), 2)[0].tolist() == [10006, 10007, 10003, 10004, 10007, -1, -1, -1]
    assert md.state_slot_mapping(positions, cyclic(5, 4096), 2)[0].tolist() == [12000, 12001, 12003, 12004, 12001, -1, -1, -1]
    cmp, idx_t = prefix(1, 128), prefix(2, 256)
    assert md.compressed_slot_mapping(positions, cmp, 128, 32)[0, :5].tolist() == [-1, 64000, -1, -1, 64063]
    assert md.compressed_slot_mapping(positions, cmp, 4, 32)[0, :4].tolist() == [-1, 64031, 64000, -1]
    assert md.compressed_slot_mapping(positions, idx_t, 4, 32)[0, :4].tolist() == [-1, 96031, 96000, -1]


# -- the reference snapshots' metadata -------------------------------------------------------


def _load(folder: Path, name: str) -> torch.Tensor:
    return torch.load(folder / "in" / f"{name}.pt", weights_only=True)


def test_swa_snapshot_metadata():
    snap = reference_snapshot("swa")
    starts = md.swa_decode_start_set(BATCH, 128, MINI.decode_start_pos)
    pos = md.position_ids_from_starts(starts, 8)
    table = md.block_table(BATCH, 32768, MINI.kv_ori_block_num)
    idx, lens = md.swa_indices_and_lens(pos, table, 32, 128)
    for r in range(2):  # every rank has the same batch and start set
        assert torch.equal(pos.reshape(-1), _load(snap, "position_ids")[r])
        assert torch.equal(md.paged_slot_mapping(pos, table, 32).reshape(-1), _load(snap, "swa_slot_mapping")[r])
        assert torch.equal(idx, _load(snap, "swa_indices")[r])
        assert torch.equal(lens, _load(snap, "swa_lens")[r])


def test_hca_snapshot_metadata():
    snap = reference_snapshot("hca")
    starts = md.hca_decode_start_set(BATCH, 128, 8, MINI.decode_start_pos)
    pos = md.position_ids_from_starts(starts, 8)
    assert torch.equal(pos.reshape(-1), _load(snap, "position_ids")[0])
    assert torch.equal(md.kv_seq_lens_from_starts(starts, 8), _load(snap, "kv_seq_lens")[0])
    state_table = _load(snap, "compress_state_block_table")[0]
    width = MINI.long_context_max_seq_len // MINI.c128_state_block_size
    assert torch.equal(state_table, md.block_table(BATCH, width, MINI.hca_state_physical_blocks))  # no re-placement
    assert torch.equal(md.state_slot_mapping(pos, state_table, 8).reshape(-1), _load(snap, "state_slot_mapping")[0])
    cmp = md.compressed_slot_mapping(pos, _load(snap, "cmp_block_table")[0], 128, 32)
    assert torch.equal(cmp.reshape(-1), _load(snap, "cmp_slot_mapping")[0])


def test_csa_snapshot_mappings():
    snap = reference_snapshot("csa")
    starts = md.csa_decode_start_set(2 * BATCH, 8, 4, 2, 64, 128, MINI.decode_start_pos)  # the global batch, split
    assert starts == [s for r in range(2) for s in _load(snap, "position_ids")[r].view(BATCH, 8)[:, 0].tolist()]
    for r in range(2):
        pos = _load(snap, "position_ids")[r].view(BATCH, 8)
        assert torch.equal(md.kv_seq_lens_from_starts(pos[:, 0], 8), _load(snap, "kv_seq_lens")[r])
        for table, mapping in (("cmp_block_table", "cmp_slot_mapping"), ("idx_block_table", "idx_slot_mapping")):
            got = md.compressed_slot_mapping(pos, _load(snap, table)[r], 4, 32).reshape(-1)
            assert torch.equal(got, _load(snap, mapping)[r]), mapping
        for table, mapping in (
            ("compress_state_block_table", "state_slot_mapping"),
            ("inner_compress_state_block_table", "inner_state_slot_mapping"),
        ):
            got = md.state_slot_mapping(pos, _load(snap, table)[r], 2).reshape(-1)
            assert torch.equal(got, _load(snap, mapping)[r]), mapping
