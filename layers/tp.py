"""The default implementation under test, `TorchTP`: the layer's own torch TP forward.

Users name it as `impl` (the config default) or subclass it.
"""

from __future__ import annotations

import torch

from .contract.context import RankContext


class TorchTP:
    """The default implementation under test: the layer's own torch TP forward."""

    def __call__(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from . import scopes  # here: layers.scopes imports the layers

        return scopes.get_scope(ctx.case.layer, ctx.case.scope).forward(ctx, tensors)


__all__ = ["TorchTP"]
