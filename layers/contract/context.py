"""What an implementation under test knows about the rank it runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .case import Case
from .config import ModelConfig

if TYPE_CHECKING:  # torch.distributed is only needed by the TP code paths.
    from torch.distributed import ProcessGroup


@dataclass
class RankContext:
    case: Case
    rank: int
    device: torch.device
    group: "ProcessGroup | None" = None  # None only when tp == 1 and no process group exists

    @property
    def model(self) -> ModelConfig:
        return self.case.model

    @property
    def tp(self) -> int:
        return self.case.tp


__all__ = ["RankContext"]
