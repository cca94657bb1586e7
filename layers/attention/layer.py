"""What the three attention layers share beyond their stages: the O weights of the fixture.

An attention layer's fixture is the rank's tensors (`inputs_without_o`) plus its shard of the
O weights drawn from the layer's `o_recipe` (`layers.attention.o_weights`). A rank that
computes its golden needs the full weights too: `rank_inputs_and_full_o` draws them once and
slices the shard from them, or, called by every rank of the group, each draws its own share of
them and of the replicated weights and the group exchanges them
(`rank_inputs_and_full_o_by_the_group`).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from ..contract.case import Case
from ..contract.config import ConfigError
from ..contract.tensors import Kind
from ..fixtures.draw import GroupExchange
from ..fixtures.kept import drawn_by_the_group
from .o_weights import OWeightRecipe, shard_of
from ..contract.staged import StagedLayer


class AttentionLayer(StagedLayer):
    o_recipe: ClassVar[OWeightRecipe]

    @abc.abstractmethod
    def inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        """Every input and in-out tensor of rank r but wo_a / wo_b / wo_b_scale."""

    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return self._ordered(case, {**self.inputs_without_o(case, rank), **self.o_recipe.shard(case, rank)})

    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        full = self.o_recipe.full(case)
        return full["wo_a"], full["wo_b"]

    def rank_inputs_and_full_o(self, case: Case, rank: int):
        full = self.o_recipe.full(case)
        inputs = self._ordered(case, {**self.inputs_without_o(case, rank), **shard_of(case, rank, full)})
        return inputs, (full["wo_a"], full["wo_b"])

    def rank_inputs_and_full_o_by_the_group(self, case: Case, exchange: GroupExchange):
        """`rank_inputs_and_full_o` with the replicated weights and the O weights drawn a share
        per rank and exchanged (`layers.fixtures.kept.drawn_by_the_group`,
        `OWeightRecipe.shard_and_full_by_the_group`): every rank of the group calls it."""
        with drawn_by_the_group(exchange):
            inputs = self.inputs_without_o(case, exchange.rank)
        shard, full = self.o_recipe.shard_and_full_by_the_group(case, exchange.rank, exchange.all_gather)
        return self._ordered(case, {**inputs, **shard}), full

    def _ordered(self, case: Case, built: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: built[n] for n, spec in self.tensor_specs(case).items() if spec.kind is not Kind.OUTPUT}


def check_distinct_writes(rank: int, starts: list[int], mapping: str, pool: str, slots: torch.Tensor,
                          why: str = "") -> None:
    """Refuse start positions whose slot mapping writes one pool row from two tokens: the
    pool comparators need distinct write rows per rank (the golden's later write would win)."""
    rows, counts = torch.unique(slots[slots >= 0], return_counts=True)
    if (counts > 1).any():
        row = int(rows[counts > 1][0])
        tokens = torch.nonzero(slots == row).reshape(-1).tolist()
        raise ConfigError(
            f"rank {rank}: start positions {starts} make {mapping} write {pool} row {row} from tokens {tokens}"
            f"{why}; the pool comparator needs distinct write rows per rank"
        )


__all__ = ["AttentionLayer", "check_distinct_writes"]
