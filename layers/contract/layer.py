"""The interface between the orchestrator and a decode layer (or a focused scope of one).

A `Layer` knows, for one `Case`: which tensors a rank holds, how to build rank r's slice
deterministically, the full (unsharded) O weights the golden needs, the single-device golden
of one rank's shard, its own TP implementation, and the checks its outputs are judged by (as
data; the launcher builds the comparators).

An implementation under test is any callable `impl(ctx: RankContext, tensors) -> outputs`:
`tensors` holds the rank's inputs and in-out tensors on `ctx.device` (O weights sharded), and
it returns `x_out` and every in-out tensor after the step (mutating them in place is fine).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from .case import Case
from .checks import Check
from .context import RankContext
from .tensors import Kind, TensorSpec


class Layer(abc.ABC):
    name: ClassVar[str]
    # The golden projects with the full O weights (`full_o_weights`) in place of the rank's
    # shards; a focused scope without a sharded projection sets False.
    sharded_o_weights: ClassVar[bool] = True
    # A golden that reads every rank's data (the MoE routes, through the harness's all-gather:
    # `rank_golden`) is computed by the group together, so the golden cache serves it only
    # where every rank of the group holds its entry.
    golden_reads_every_rank: ClassVar[bool] = False
    # The inputs (in-outs before the step included) every rank of a group holds alike in every
    # case: drawn from the seed and model alone, or from the group's whole batch. The golden
    # cache stores them once per group instead of once per rank.
    replicated_inputs: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def validate(self, case: Case) -> None:
        """Raise ConfigError for a case this layer cannot run (before any process starts).
        The case has passed `Case.validate` (the TP-level rules every layer shares)."""

    @abc.abstractmethod
    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        """Every tensor of one rank in the spec's order (wo_a / wo_b as the rank's shard)."""

    @abc.abstractmethod
    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s inputs and in-out initial values, built without the other ranks'."""

    @abc.abstractmethod
    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        """The unsharded `(wo_a [G, OL, GI], wo_b [D, G*OL])` the golden projects with."""

    def rank_inputs_and_full_o(self, case: Case, rank: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """`rank_inputs` and `full_o_weights` together, for a rank that computes its golden.
        This default builds them apart; `layers.attention.o_weights` draws the O weights once."""
        return self.rank_inputs(case, rank), self.full_o_weights(case)

    @abc.abstractmethod
    def golden(self, case: Case, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The golden on one process: the single-device layer on one rank's tensors of `case`
        with full O weights (the reference's TP1 golden on that rank's shard); in-outs updated
        in place. A golden that reads every rank's data takes the group's tensors stacked
        [P, ...] and returns its outputs stacked so."""

    def rank_golden(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's golden outputs in a launch: `golden` of the rank's own tensors. A layer
        whose golden reads every rank's data overrides it to take that data through `ctx.group`
        with the harness's own collectives (`layers.distributed.wire`), never the implementation's."""
        return self.golden(ctx.case, tensors)

    @abc.abstractmethod
    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This project's TP implementation of the layer on one rank."""

    @abc.abstractmethod
    def checks(self, case: Case) -> tuple[Check, ...]:
        """The comparators of every compared output, in the spec's validation order."""

    def start_positions(self, case: Case) -> list[list[int]] | None:
        """Every rank's request start positions (rank r's list first to last request), as the
        case's `start_pos` resolves them; None for a scope without requests."""
        return None

    # -- derived helpers ---------------------------------------------------------------------
    def compared_names(self, case: Case) -> tuple[str, ...]:
        return tuple(c.output for c in self.checks(case))

    def names_of(self, case: Case, kind: Kind) -> tuple[str, ...]:
        return tuple(n for n, s in self.tensor_specs(case).items() if s.kind is kind)


__all__ = ["Layer"]
