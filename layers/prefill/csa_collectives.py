"""The CSA CP prefill exchanges alone, exact on integer data: `layer=csa phase=prefill
scope=collectives` (HCA's: layers/prefill/hca_collectives.py), zigzag only.

Runs the two exchange stages of the CSA stage list, replaced by name as in the full layer
(`layers.tp.TorchTP.run_stage`):

| stage            | input (per rank)                                     | output (compared bitwise)                |
|------------------|------------------------------------------------------|------------------------------------------|
| tail_exchange    | local_kv_tail [2·WIN, HD], local_hidden_tail [2·WIN, D], reverse_index | logical_tails_out, logical_hidden_tails [2cp, WIN, ·] |
| compact_exchange | main_payload [128, HD], idx_payload [128, ID] int8, idx_scale_payload [128, 1], record_meta [128, 8], main_state_payload [8, 4·HD], inner_state_payload [8, 4·ID], state_meta [8], the five pools and their four tables | cmp_kv, idx_kv_cache, idx_kv_scale, compress_state, inner_compress_state |

Every payload row is `collectives.block_rows`' closed form (column 0 the block it leaves,
2·rank + part, column 1 its row): the int8 rows shifted by −128 into int8's range, each scale
the row's number (block·64 + row), the inner state rows part 1's block so that they differ from
the main's. The metadata is the case's: each part's blocks that end in its segment (logical
slot, end) and, on the final segment's owner, the step's last ≤ 8 positions (count, first).
The pools start at zero with the full layer's tables, so a row committed nowhere, twice or
through the wrong table shows. The golden rebuilds every rank's sources and places each
compressed row by its block's position (the segment that holds its end, that segment's owner
and part), never from the metadata the stage reads.
"""

from __future__ import annotations

import torch

from ..contract.checks import Check, ExactCheck
from ..contract.config import ConfigError
from ..contract.context import RankContext
from ..contract.stage import Stage
from ..contract.staged import RunStage, default_run_stage, run_stages
from ..contract.tensors import Kind, TensorSpec
from . import csa, csa_fixture, csa_tables, tables
from .case import PrefillCase
from .collectives import PrefillCollectivesScope, block_rows, logical_tails, stacked_sources
from .csa_tables import ROWS_PER_SEGMENT

STAGES = ("tail_exchange", "compact_exchange")
COMPARED = ("logical_tails_out", "logical_hidden_tails", *csa_fixture.POOLS)


def part_blocks(case: PrefillCase, segment: int) -> list[int]:
    """The ends of the 4-position blocks that end in `segment`."""
    start = case.starts[segment]
    return csa_tables.boundaries(start, start + case.lengths[segment])


def compact_sources(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """Rank's compact-exchange payloads (closed form) and their metadata (the case's)."""
    m, n = case.model, csa_tables.STATE_LEN
    meta = torch.full((csa.PAYLOAD_ROWS, csa_tables.META_DIM), -1, dtype=torch.int32)
    for part, segment in enumerate(tables.owner_segments(case)[rank]):
        for i, end in enumerate(part_blocks(case, segment)):
            meta[part * ROWS_PER_SEGMENT + i, :2] = torch.tensor([(end + 1) // csa_tables.COMPRESS_RATIO - 1, end])
    state_meta = torch.zeros(csa_tables.META_DIM, dtype=torch.int32)
    if tables.owner(case, case.num_segments - 1)[0] == rank:
        first, count = csa_tables.final_state_positions(case)
        state_meta[:2] = torch.tensor([count, first])
    numbered = block_rows(rank, ROWS_PER_SEGMENT, 2, torch.float32)
    return {"main_payload": block_rows(rank, ROWS_PER_SEGMENT, m.head_dim),
            "idx_payload": (block_rows(rank, ROWS_PER_SEGMENT, m.index_head_dim, torch.int32) - 128).to(torch.int8),
            "idx_scale_payload": numbered[:, :1] * ROWS_PER_SEGMENT + numbered[:, 1:],
            "record_meta": meta,
            "main_state_payload": block_rows(rank, n, 4 * m.head_dim, torch.float32)[:n],
            "inner_state_payload": block_rows(rank, n, 4 * m.index_head_dim, torch.float32)[n:],
            "state_meta": state_meta}


def empty_pools(case: PrefillCase) -> dict[str, torch.Tensor]:
    m, sb, cb = case.model, csa_tables.STATE_BLOCK_SIZE, csa_tables.CMP_STORAGE_BLOCK_SIZE
    states = csa_tables.STATE_PHYSICAL_BLOCKS
    return {"compress_state": torch.zeros(states, sb, 4 * m.head_dim),
            "inner_compress_state": torch.zeros(states, sb, 4 * m.index_head_dim),
            "cmp_kv": torch.zeros(csa_tables.CMP_BLOCK_NUM, cb, 1, m.head_dim, dtype=torch.bfloat16),
            "idx_kv_cache": torch.zeros(csa_tables.IDX_BLOCK_NUM, cb, 1, m.index_head_dim, dtype=torch.int8),
            "idx_kv_scale": torch.zeros(csa_tables.IDX_BLOCK_NUM, cb, 1, 1),
            "cmp_block_table": csa_tables.cmp_table(case),
            "idx_block_table": csa_tables.idx_table(case),
            "compress_state_block_table": csa_tables.state_table(case),
            "inner_compress_state_block_table": csa_tables.inner_state_table(case)}


def sources(case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
    """Every input of rank (the pools empty, their tables the full layer's)."""
    m, win = case.model, case.window
    return {"local_kv_tail": block_rows(rank, win, m.head_dim), "local_hidden_tail": block_rows(rank, win, m.hidden_size),
            "reverse_index": tables.reverse_index(case), **compact_sources(case, rank), **empty_pools(case)}


def expected_pools(case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The receiving rank's five pools after the compact exchange: each block of the step at its
    slot's rows (through the rank's own cmp and idx tables), taken from the payloads of the
    rank and part that own the segment holding the block's end; the final owner's state rows
    of both compressors at the positions' rows of the rank's own two state tables."""
    pools = {n: tensors[n].clone() for n in csa_fixture.POOLS}
    flat = {n: t.view(-1, t.shape[-1]) for n, t in pools.items()}
    for segment in range(case.num_segments):
        rank, part = tables.owner(case, segment)
        sent = compact_sources(case, rank)
        for i, end in enumerate(part_blocks(case, segment)):
            slot, row = torch.tensor([(end + 1) // csa_tables.COMPRESS_RATIO - 1]), part * ROWS_PER_SEGMENT + i
            flat["cmp_kv"][csa_tables.cmp_rows(tensors["cmp_block_table"], slot)] = sent["main_payload"][row]
            at = csa_tables.cmp_rows(tensors["idx_block_table"], slot)
            flat["idx_kv_cache"][at] = sent["idx_payload"][row]
            flat["idx_kv_scale"][at] = sent["idx_scale_payload"][row]
    first, count = csa_tables.final_state_positions(case)
    owner = compact_sources(case, tables.owner(case, case.num_segments - 1)[0])
    for pool, table, _, payload in csa.STATE_POOLS:
        flat[pool][csa_tables.state_rows(tensors[table], torch.arange(first, first + count))] = owner[payload][:count]
    return pools


class PrefillCSACollectivesScope(PrefillCollectivesScope):
    """`layer=csa phase=prefill scope=collectives`: the zigzag exchanges alone, bitwise (the SWA
    scope's frame: no O weights, reverse_index held once)."""

    name = "csa"

    def stages(self, model) -> tuple[Stage, ...]:
        return tuple(s for s in csa.stages() if s.name in STAGES)

    def exchange_stages(self, case: PrefillCase) -> tuple[Stage, ...]:
        return self.stages(case.model)

    def validate(self, case: PrefillCase) -> None:
        case.validate()
        if case.cp_layout != "zigzag":
            raise ConfigError(f"layer=csa phase=prefill runs cp_layout=zigzag; cp_layout={case.cp_layout} is not "
                              f"built for layer=csa yet")
        csa_tables.validate(case)

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        m, win, nseg = case.model, case.window, case.num_segments
        specs = {n: TensorSpec(tuple(t.shape), t.dtype, Kind.INOUT if n in csa_fixture.POOLS else Kind.INPUT,
                               replicated=n in self.replicated_inputs)
                 for n, t in sources(case, 0).items()}
        return {**specs, "logical_tails_out": TensorSpec((nseg, win, m.head_dim), torch.bfloat16, Kind.OUTPUT),
                "logical_hidden_tails": TensorSpec((nseg, win, m.hidden_size), torch.bfloat16, Kind.OUTPUT)}

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        return sources(case, rank)

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outputs of the rank whose inputs these are, from every rank's rebuilt sources."""
        stacked = stacked_sources(case, tensors, sources, csa_fixture.POOLS, "CSA")
        return {**logical_tails(stacked, tensors["reverse_index"]), **expected_pools(case, tensors)}

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        values = run_stages(self.exchange_stages(ctx.case), ctx, tensors, run_stage)
        return {n: values[n] for n in COMPARED}

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return tuple(ExactCheck(n) for n in COMPARED)


SCOPE = PrefillCSACollectivesScope()

__all__ = ["STAGES", "COMPARED", "part_blocks", "compact_sources", "sources", "expected_pools",
           "PrefillCSACollectivesScope", "SCOPE"]
