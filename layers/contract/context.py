"""What an implementation under test knows about the rank it runs on."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .case import Case, MoECase
from .config import ModelConfig

if TYPE_CHECKING:  # torch.distributed is only needed by the TP code paths.
    from torch.distributed import ProcessGroup

    from .stage import Stage

# Runs one stage: `observe(stage, run)` calls `run()` and returns its outputs (and may record
# or time them).
StageObserver = Callable[["Stage", Callable[[], dict]], dict]


@dataclass
class RankContext:
    """`case`: the case of this rank's TP group; `rank`: this rank in its TP group; `group`:
    the TP group's process group (None when tp == 1 and none exists); `device`: where the
    tensors live. With several TP groups in one launch (dp x tp), `global_rank` is the rank in
    the whole world and `group_index` which TP group this is (ranks g·tp ... g·tp + tp − 1).
    `observe`: set by the harness while it records or times a stage-based implementation's
    stages (bisect, benchmarks); None otherwise."""

    case: Case | MoECase
    rank: int
    device: torch.device
    group: "ProcessGroup | None" = None
    observe: StageObserver | None = None
    global_rank: int | None = None  # None: the same as `rank` (one TP group)
    group_index: int = 0

    @property
    def model(self) -> ModelConfig:
        return self.case.model

    @property
    def tp(self) -> int:
        """Ranks of this rank's group: the TP group (EP group of the MoE layer)."""
        return self.case.group_size

    def single_device(self) -> "RankContext":
        """This rank alone, as the golden runs it: tp = 1, no process group, so every
        collective is the identity."""
        return dataclasses.replace(self, case=dataclasses.replace(self.case, tp=1), rank=0, group=None)


__all__ = ["RankContext", "StageObserver"]
