"""The default implementation under test, `TorchTP`: the layer's own stages on the rank's TP group.

Users name it as `impl` (the config default) or subclass it. A subclass replaces a stage by
name in `run_stage`; everything else runs as the layer's golden does, and bisect judges the
replaced stage (its outputs are recorded as the stage's):

    class MyAllToAll(TorchTP):
        def run_stage(self, stage, ctx, values):
            if stage.name == "group_all_to_all":
                return {"attention_local_groups": my_kernel(ctx, values["attention_grouped"])}
            return super().run_stage(stage, ctx, values)
"""

from __future__ import annotations

import torch

from .contract.context import RankContext
from .contract.stage import Stage, Values
from .block.layer import BlockLayer
from .registry import layer_of
from .contract.staged import StagedLayer


class TorchTP:
    """The default implementation under test: the layer's own torch TP forward."""

    def run_stage(self, stage: Stage, ctx: RankContext, values: Values) -> dict[str, torch.Tensor]:
        """Run one stage of the layer (override to replace stages by `stage.name`)."""
        return stage.run(ctx, values)

    def __call__(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scope = layer_of(ctx.case)
        if isinstance(scope, (StagedLayer, BlockLayer)):  # the block hands run_stage to its halves
            return scope.forward(ctx, tensors, run_stage=self.run_stage)
        return scope.forward(ctx, tensors)


__all__ = ["TorchTP"]
