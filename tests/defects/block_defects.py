"""Defects of layer=block: the hand-off from the attention half to the MoE half."""

from __future__ import annotations

import torch

from layers.distributed import wire
from layers.tp import TorchTP
from .stage_defect import StageDefect


# -- layer=block: the hand-off from the attention half to the MoE half ---------------------------
class BlockRowsReordered(StageDefect):
    """The hand-off gives the MoE the rank's attention rows in reverse order, not in the order the
    reduce-scatter and hc_post left them."""

    stages = ("hand_off",)

    def defective(self, stage, ctx, v):
        return stage.run(ctx, {**v, "x_out": v["x_out"].flip(0)})


class BlockRowsOfAnotherGroup(StageDefect):
    """Rank r's MoE tokens are the attention rows of rank r + tp: the same place in the next TP
    group, whose requests they are not."""

    stages = ("hand_off",)

    def defective(self, stage, ctx, v):
        case = ctx.case
        every = wire.all_gather(v["x_out"].contiguous(), ctx.group, case.ep)
        return stage.run(ctx, {**v, "x_out": every[(ctx.rank + case.tp) % case.ep]})


class BlockResidualBeforeAttention(TorchTP):
    """The MoE's hc_post mixes the residual streams the attention started from (its input x_hc),
    not those its hc_post left (the rows handed to the MoE)."""

    def run_stage(self, stage, ctx, values):
        if ctx.case.layer != "moe" and stage.name == "hc_pre" and "x_hc" in values:
            self.attention_input = values["x_hc"]
        if ctx.case.layer == "moe" and stage.name == "hc_post":
            x_hc = values["x_hc"].clone()
            x_hc[: self.attention_input.shape[0]] = self.attention_input
            values = {**values, "x_hc": x_hc}
        return super().run_stage(stage, ctx, values)


class BlockDispatchesPaddedRows(TorchTP):
    """The MoE routes all T rows of the rank, the padding past the attention's local_t rows too."""

    def run_stage(self, stage, ctx, values):
        if ctx.case.layer == "moe" and "num_tokens" in values:
            values = {**values, "num_tokens": torch.tensor(ctx.case.tokens, dtype=torch.int32)}
        return super().run_stage(stage, ctx, values)
