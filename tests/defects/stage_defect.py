"""The base of the stage defects: the default implementation with stages replaced by name."""

from __future__ import annotations

import torch

from layers.tp import TorchTP


class StageDefect(TorchTP):
    """The default implementation with the stages named in `stages` replaced by `defective`."""

    stages: tuple[str, ...]

    def defective(self, stage, ctx, values) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def run_stage(self, stage, ctx, values):
        if stage.name in self.stages:
            return self.defective(stage, ctx, values)
        return super().run_stage(stage, ctx, values)
