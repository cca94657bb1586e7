"""One stage of a layer's step: what it reads, what it writes, how it runs and how it is judged.

A layer is one ordered list of stages in its spec's order, with the spec's names (swa.md §6,
csa.md §3, hca.md §4). The golden, the TP forward and bisect all walk that one list: the
golden on a single device (tp = 1: every collective stage is the identity), the forward on
the rank's TP group, bisect stage by stage against the golden.

`run(ctx, values)` gets the tensors named in `reads` (rank tensors or earlier stages'
outputs) and returns the tensors named in `writes` (an in-out pool may be updated in place
and returned). A cross-rank stage also has a `reference`: the same data movement computed
from every rank's inputs stacked `[P, ...]` (the `every_rank` names), so that bisect can judge
it without running the collective under test.

Each written tensor carries two checks: `check` judges it against the golden stage re-run on
the implementation's own inputs; `chain_check` against the golden's own chain, where the
implementation did not expose the stage's inputs (None: `check`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .checks import Check

Values = Mapping[str, torch.Tensor]
# (ctx: layers.contract.context.RankContext, values) -> outputs; the context module builds on
# this one, so the type is named here only in words.
StageFn = Callable[[Any, Values], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class StageOutput:
    check: Check
    chain_check: Check | None = None

    @property
    def name(self) -> str:
        return self.check.output


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...]
    writes: tuple[StageOutput, ...]
    run: StageFn
    reference: StageFn | None = None  # cross-rank stages only: from every rank's inputs
    every_rank: tuple[str, ...] = ()  # the inputs `reference` reads stacked [P, ...]

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.writes)

    def golden(self, ctx, values: Values) -> dict[str, torch.Tensor]:
        """The stage alone as the golden computes it on these inputs (bisect's judge)."""
        return (self.reference or self.run)(ctx, values)


__all__ = ["Stage", "StageOutput", "StageFn", "Values"]
