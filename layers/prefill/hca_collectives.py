"""The HCA CP prefill exchanges alone, exact on integer data: `layer=hca phase=prefill
scope=collectives` (the SWA prefill's is layers/prefill/collectives.py).

Runs the layout's own exchange stages of the HCA stage lists, replaced by name as in the full
layer (`layers.tp.TorchTP.run_stage`):

| layout     | stage            | input (per rank)                                    | output (compared bitwise)                    |
|------------|------------------|-----------------------------------------------------|----------------------------------------------|
| zigzag     | tail_exchange    | local_kv_tail [2·WIN, HD], local_hidden_tail [2·WIN, D], reverse_index | logical_tails_out, logical_hidden_tails [2cp, WIN, ·] |
| zigzag     | compact_exchange | local_cmp_payload [4, HD] + local_cmp_meta [4, 8], local_state_payload [WIN, 2·HD] + local_state_meta [8], the pools and their tables | cmp_kv, compress_state |
| contiguous | kv_allgather     | kv [2·tiles·WIN, HD], local_state [2·tiles·WIN, 2·HD] | gathered_kv, gathered_state (rank-major)  |

Every payload row is `collectives.block_rows`' closed form (column 0 the block it leaves, 2·rank
+ part, column 1 its row, integers below 256), so a row at the wrong place names itself. The
metadata is the case's: each part's blocks that end in its segment (logical slot, end) and,
on the final segment's owner, the step's last ≤ 128 positions (count, first); the pools start
at zero, so a row committed nowhere or twice shows. The golden rebuilds every rank's sources
and places each compressed row by the block's position (the segment that holds its end, that
segment's owner and part), never from the metadata the stage reads.
"""

from __future__ import annotations

import torch

from ..components.hca_compressor import COMPRESS_RATIO
from ..contract.checks import Check, ExactCheck
from ..contract.context import RankContext
from ..contract.stage import Stage
from ..contract.staged import RunStage, default_run_stage, run_stages
from ..contract.tensors import Kind, TensorSpec
from . import exchange, hca, hca_gathered, hca_tables, tables
from .case import MAX_SEGMENT_TILES, PrefillCase
from .collectives import PrefillCollectivesScope, block_rows, logical_tails, stacked_sources

# layout -> (its exchange stages, the outputs compared)
EXCHANGES = {"zigzag": (("tail_exchange", "compact_exchange"),
                        ("logical_tails_out", "logical_hidden_tails", "cmp_kv", "compress_state")),
             "contiguous": (("kv_allgather",), ("gathered_kv", "gathered_state"))}
POOLS = ("cmp_kv", "compress_state")


def part_blocks(case: PrefillCase, segment: int) -> list[int]:
    """The ends of the 128-position blocks that end in `segment`."""
    start = case.starts[segment]
    return hca_tables.boundaries(start, start + case.lengths[segment])


def compact_sources(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """Rank's compact-exchange payloads (closed form) and their metadata (the case's)."""
    hd, win = case.model.head_dim, case.window
    meta = torch.full((hca.CMP_ROWS, hca_tables.META_DIM), -1, dtype=torch.int32)
    for part, segment in enumerate(tables.owner_segments(case)[rank]):
        for i, end in enumerate(part_blocks(case, segment)):
            meta[part * hca_tables.CMP_ROWS_PER_SEGMENT + i, :2] = torch.tensor([(end + 1) // COMPRESS_RATIO - 1, end])
    state_meta = torch.zeros(hca_tables.META_DIM, dtype=torch.int32)
    if tables.owner(case, hca_tables.final_segment(case))[0] == rank:
        first, count = hca_tables.final_state_positions(case)
        state_meta[:2] = torch.tensor([count, first])
    return {"local_cmp_payload": block_rows(rank, hca_tables.CMP_ROWS_PER_SEGMENT, hd),
            "local_cmp_meta": meta,
            "local_state_payload": block_rows(rank, win, 2 * hd, torch.float32)[:win],
            "local_state_meta": state_meta}


def empty_pools(case: PrefillCase) -> dict[str, torch.Tensor]:
    hd, sb = case.model.head_dim, hca_tables.state_block_size(case)
    return {"cmp_kv": torch.zeros(hca_tables.CMP_BLOCK_NUM, hca_tables.CMP_STORAGE_BLOCK_SIZE, 1, hd,
                                  dtype=torch.bfloat16),
            "compress_state": torch.zeros(hca_tables.STATE_PHYSICAL_BLOCKS, sb, 2 * hd),
            "cmp_block_table": hca_tables.cmp_table(case),
            "compress_state_block_table": hca_tables.state_table(case)}


def sources(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """Every input of rank (the pools empty, their tables the full layer's)."""
    m, win = case.model, case.window
    if case.cp_layout == "contiguous":
        rows = MAX_SEGMENT_TILES * win
        return {"kv": block_rows(rank, rows, m.head_dim),
                "local_state": block_rows(rank, rows, 2 * m.head_dim, torch.float32)}
    return {"local_kv_tail": block_rows(rank, win, m.head_dim), "local_hidden_tail": block_rows(rank, win, m.hidden_size),
            "reverse_index": tables.reverse_index(case), **compact_sources(case, rank), **empty_pools(case)}


def expected_pools(case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The receiving rank's pools after the compact exchange: each block of the step at its
    slot's row (through the rank's own cmp_block_table), taken from the payload of the rank
    and part that own the segment holding the block's end; the final owner's state rows at
    the positions' rows of its own compress_state_block_table."""
    hd, sb = case.model.head_dim, hca_tables.state_block_size(case)
    cmp_kv, state = tensors["cmp_kv"].clone(), tensors["compress_state"].clone()
    for segment in range(case.num_segments):
        rank, part = tables.owner(case, segment)
        payload = compact_sources(case, rank)["local_cmp_payload"]
        for i, end in enumerate(part_blocks(case, segment)):
            row = hca_tables.cmp_rows(tensors["cmp_block_table"], torch.tensor([(end + 1) // COMPRESS_RATIO - 1]))
            cmp_kv.view(-1, hd)[row] = payload[part * hca_tables.CMP_ROWS_PER_SEGMENT + i]
    first, count = hca_tables.final_state_positions(case)
    owner = tables.owner(case, hca_tables.final_segment(case))[0]
    rows = hca_tables.state_rows(tensors["compress_state_block_table"], torch.arange(first, first + count), sb)
    state.view(-1, 2 * hd)[rows] = compact_sources(case, owner)["local_state_payload"][:count]
    return {"cmp_kv": cmp_kv, "compress_state": state}


class PrefillHCACollectivesScope(PrefillCollectivesScope):
    """`layer=hca phase=prefill scope=collectives`: the layout's exchanges alone, bitwise (the
    SWA scope's frame: no O weights, reverse_index held once)."""

    name = "hca"

    def stages(self, model) -> tuple[Stage, ...]:
        """Both layouts' exchanges by name; `forward` walks the case's."""
        every = {s.name: s for s in (*hca.stages(), *hca_gathered.stages())}
        return tuple(every[name] for names, _ in EXCHANGES.values() for name in names)

    def exchange_stages(self, case: PrefillCase) -> tuple[Stage, ...]:
        names = EXCHANGES[case.cp_layout][0]
        return tuple(s for s in self.stages(case.model) if s.name in names)

    def validate(self, case: PrefillCase) -> None:
        case.validate()
        hca_tables.check_case(case)

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        m, win, nseg = case.model, case.window, case.num_segments
        specs = {n: TensorSpec(tuple(t.shape), t.dtype, Kind.INOUT if n in POOLS else Kind.INPUT,
                               replicated=n in self.replicated_inputs)
                 for n, t in sources(case, 0).items()}
        if case.cp_layout == "contiguous":
            rows = case.cp * tables.LOCAL_PARTS * MAX_SEGMENT_TILES * win
            return {**specs, "gathered_kv": TensorSpec((rows, m.head_dim), torch.bfloat16, Kind.OUTPUT),
                    "gathered_state": TensorSpec((rows, 2 * m.head_dim), torch.float32, Kind.OUTPUT)}
        return {**specs, "logical_tails_out": TensorSpec((nseg, win, m.head_dim), torch.bfloat16, Kind.OUTPUT),
                "logical_hidden_tails": TensorSpec((nseg, win, m.hidden_size), torch.bfloat16, Kind.OUTPUT)}

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        return sources(case, rank)

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outputs of the rank whose inputs these are, from every rank's rebuilt sources."""
        stacked = stacked_sources(case, tensors, sources, POOLS, "HCA")
        if case.cp_layout == "contiguous":
            return {"gathered_kv": exchange.rank_major(stacked["kv"]),
                    "gathered_state": exchange.rank_major(stacked["local_state"])}
        return {**logical_tails(stacked, tensors["reverse_index"]), **expected_pools(case, tensors)}

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        values = run_stages(self.exchange_stages(ctx.case), ctx, tensors, run_stage)
        return {n: values[n] for n in EXCHANGES[ctx.case.cp_layout][1]}

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return tuple(ExactCheck(n) for n in EXCHANGES[case.cp_layout][1])


SCOPE = PrefillHCACollectivesScope()

__all__ = ["EXCHANGES", "part_blocks", "compact_sources", "sources", "expected_pools", "PrefillHCACollectivesScope",
           "SCOPE"]
