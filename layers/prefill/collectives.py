"""The CP prefill exchange alone, exact on integer data: `layer=swa phase=prefill
scope=collectives` (the counterpart of the decode layers' scope, layers/attention/scopes.py and
layers/moe/collectives.py), so a CP exchange kernel is tested without the layer around it.

Runs the layout's own exchange stage: zigzag, `tail_exchange` (every rank's two tails to every
peer, read back in logical order through `reverse_index`); contiguous, `kv_allgather` (every
rank's projected KV rows, rank-major). A stage-based implementation replaces the stage by name
(`layers.tp.TorchTP.run_stage`), as in the full layer. The golden rebuilds every rank's source
(a pure function of the case and the rank) and moves the rows itself; outputs compare bitwise.

Source of rank r (bf16, every value an integer below 256, exact), part p, row i of the part,
column c:

| column | value                                     |
|--------|-------------------------------------------|
| 0      | 2·r + p (the rank-major block it leaves)  |
| 1      | i                                         |
| c ≥ 2  | ((2·r + p)·rows + i)·HD + c  mod 251       |

so a block that lands at the wrong place, or a row moved within its block, names itself.

| layout     | input                              | output                                    |
|------------|------------------------------------|-------------------------------------------|
| zigzag     | local_kv_tail [2·WIN, HD], reverse_index [2cp] | logical_tails_out [2cp, WIN, HD] |
| contiguous | kv [2·tiles·WIN, HD]               | gathered_kv [cp·2·tiles·WIN, HD]          |
"""

from __future__ import annotations

import torch

from ..contract.checks import Check, ExactCheck
from ..contract.context import RankContext
from ..contract.stage import Stage
from ..contract.staged import RunStage, StagedLayer, default_run_stage, run_stages
from ..contract.tensors import Kind, TensorSpec
from . import exchange, gathered, swa, tables
from .case import MAX_SEGMENT_TILES, PrefillCase

# layout -> (the exchange stage, its source, its output)
EXCHANGES = {"zigzag": ("tail_exchange", "local_kv_tail", "logical_tails_out"),
             "contiguous": ("kv_allgather", "kv", "gathered_kv")}


def part_rows(case: PrefillCase) -> int:
    """Rows of one part of a rank's source: a tail (zigzag) or a segment's tiles (contiguous)."""
    return case.window if case.cp_layout == "zigzag" else MAX_SEGMENT_TILES * case.window


def block_rows(rank: int, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rank's two parts of `rows` rows [2·rows, cols] (the module docstring's table): integers
    below 256, exact in bf16 and fp32."""
    block = (2 * rank + torch.arange(tables.LOCAL_PARTS))[:, None, None]
    row = torch.arange(rows)[None, :, None]
    col = torch.arange(cols)[None, None, :]
    values = ((block * rows + row) * cols + col) % 251
    values = torch.where(col == 0, block, torch.where(col == 1, row, values)).expand(-1, rows, cols)
    return values.reshape(-1, cols).to(dtype)


def source_rows(case: PrefillCase, rank: int) -> torch.Tensor:
    """Rank's source [2·rows, HD] bf16."""
    return block_rows(rank, part_rows(case), case.model.head_dim)


def stacked_sources(case: PrefillCase, tensors: dict[str, torch.Tensor], sources, kept: tuple[str, ...],
                    layer: str) -> dict[str, torch.Tensor]:
    """Every rank's rebuilt `sources(case, rank)` but the pools, tables and reverse_index, stacked
    [cp, ...]; refused unless `tensors` (one rank's inputs) are one of them."""
    every = [sources(case, r) for r in range(case.cp)]
    moved = [n for n in every[0] if n not in kept and not n.endswith("table") and n != "reverse_index"]
    if not any(all(torch.equal(tensors[n], e[n]) for n in moved) for e in every):
        raise ValueError(f"the {layer} prefill collectives golden needs its own closed-form sources; these differ "
                         f"from them")
    return {n: torch.stack([e[n] for e in every]) for n in moved}


def logical_tails(stacked: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Both tails' golden (HCA's and CSA's tail exchange): every rank's KV and hidden-row tails
    in logical order."""
    return {"logical_tails_out": exchange.to_logical(stacked["local_kv_tail"], index),
            "logical_hidden_tails": exchange.to_logical(stacked["local_hidden_tail"], index)}


class PrefillCollectivesScope(StagedLayer):
    """`phase=prefill scope=collectives`: the layout's exchange alone, bitwise."""

    name = "swa"
    scope = "collectives"
    sharded_o_weights = False
    replicated_inputs = frozenset({"reverse_index"})

    def stages(self, model) -> tuple[Stage, ...]:
        """Both layouts' exchanges by name; `forward` walks the case's one."""
        every = {s.name: s for s in (*swa.stages(), *gathered.stages())}
        return tuple(every[stage] for stage, _, _ in EXCHANGES.values())

    def exchange_stage(self, case: PrefillCase) -> Stage:
        """The case's layout's exchange."""
        name = EXCHANGES[case.cp_layout][0]
        return next(s for s in self.stages(case.model) if s.name == name)

    def validate(self, case: PrefillCase) -> None:
        case.validate()

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        _, source, output = EXCHANGES[case.cp_layout]
        rows, hd, bf16 = part_rows(case), case.model.head_dim, torch.bfloat16
        specs = {source: TensorSpec((tables.LOCAL_PARTS * rows, hd), bf16, Kind.INPUT)}
        if case.cp_layout == "zigzag":
            specs["reverse_index"] = TensorSpec((case.num_segments,), torch.int32, Kind.INPUT, replicated=True)
            specs[output] = TensorSpec((case.num_segments, rows, hd), bf16, Kind.OUTPUT)
        else:
            specs[output] = TensorSpec((case.cp * tables.LOCAL_PARTS * rows, hd), bf16, Kind.OUTPUT)
        return specs

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        _, source, _ = EXCHANGES[case.cp_layout]
        extra = {"reverse_index": tables.reverse_index(case)} if case.cp_layout == "zigzag" else {}
        return {source: source_rows(case, rank), **extra}

    def full_o_weights(self, case: PrefillCase):
        raise TypeError("phase=prefill scope=collectives has no O weights")

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The output of the rank whose source these are, from every rank's rebuilt source."""
        _, source, output = EXCHANGES[case.cp_layout]
        every = torch.stack([source_rows(case, r) for r in range(case.cp)])
        if not any(torch.equal(tensors[source], s) for s in every):
            raise ValueError("the prefill collectives golden needs its own closed-form sources; these differ from them")
        if case.cp_layout == "zigzag":
            return {output: exchange.to_logical(every, tensors["reverse_index"])}
        return {output: exchange.rank_major(every)}

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        output = EXCHANGES[ctx.case.cp_layout][2]
        return {output: run_stages((self.exchange_stage(ctx.case),), ctx, tensors, run_stage)[output]}

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return (ExactCheck(EXCHANGES[case.cp_layout][2]),)


SCOPE = PrefillCollectivesScope()

__all__ = ["EXCHANGES", "part_rows", "block_rows", "source_rows", "stacked_sources", "logical_tails", "PrefillCollectivesScope", "SCOPE"]
