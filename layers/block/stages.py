"""The block's one stage list: its attention layer's stages, the hand-off, its MoE's stages.

Each half's stages are the half's own objects, wrapped so that they run on the block's world
context: an attention stage as rank r % tp of TP group r // tp (`attention_context`), a MoE
stage as rank r of the world (`moe_context`). A wrapped stage is named `<half>.<stage>`
(`csa.reduce_scatter`, `moe.dispatch`; the hand-off is `hand_off`), so bisect and the stage
benchmark name the half; the `run_stage` it calls gets the half's own stage and context, so an
implementation replaces a stage of either half by the half's name for it (`ctx.case.layer`
says which half).

A cross-rank stage's `reference` reads every rank's inputs stacked over the world (bisect
gathers them on the block's world group); an attention stage's takes its TP group's rows.
The tensors of both halves share one namespace in order: the hand-off writes the MoE's `x_hc`
over the attention's input of that name once the attention is done with it, and the MoE's
hc_pre outputs replace the attention's likewise.
"""

from __future__ import annotations

import dataclasses

import torch

from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import RunStage, StagedLayer, default_run_stage, exact, judged
from ..csa import layer as csa
from ..hca import layer as hca
from ..moe import layer as moe
from ..swa import layer as swa
from .case import BlockCase

# The MoE fixture's own x_hc, renamed: the block's x_hc is the attention's input. Its rows
# past local_t pad the rank's MoE tokens (inactive: never routed).
MOE_RESIDUAL = "ffn_x_hc"
ATTENTION_OUTPUT = "x_out"


# The block's halves by name: each attention kind, and the MoE.
HALVES: dict[str, StagedLayer] = {m.LAYER.name: m.LAYER for m in (swa, csa, hca, moe)}


def half(name: str) -> StagedLayer:
    """A half of the block by its layer name."""
    return HALVES[name]


def hand_off(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The rank's local_t attention rows, as the reduce-scatter and hc_post left them, as its
    first MoE tokens; the MoE fixture's rows after them are the padding."""
    x_hc = v[MOE_RESIDUAL].clone()
    x_hc[: v[ATTENTION_OUTPUT].shape[0]] = v[ATTENTION_OUTPUT]
    return {"x_hc": x_hc}


HAND_OFF = Stage("hand_off", (ATTENTION_OUTPUT, MOE_RESIDUAL), (judged(exact("x_hc")),), hand_off)


def attention_context(ctx: RankContext, group=None) -> RankContext:
    """World rank `ctx.rank` as a rank of its attention TP group (`group`: its process group;
    None where no collective runs, or at tp = 1)."""
    case: BlockCase = ctx.case
    g = case.tp_group_of(ctx.rank)
    return RankContext(case=case.attention_case(g), rank=ctx.rank % case.tp, device=ctx.device, group=group,
                       global_rank=ctx.rank, group_index=g)


def moe_context(ctx: RankContext) -> RankContext:
    return dataclasses.replace(ctx, case=ctx.case.moe_case(), observe=None)


def _attention_stage(stage: Stage, case: BlockCase, run_stage: RunStage, group) -> Stage:
    def run(ctx, v):
        return run_stage(stage, attention_context(ctx, group), v)

    def reference(ctx, v):
        g, tp = case.tp_group_of(ctx.rank), case.tp
        mine = {n: x[g * tp : (g + 1) * tp] if n in stage.every_rank else x for n, x in v.items()}
        return stage.reference(attention_context(ctx), mine)

    return dataclasses.replace(stage, name=f"{case.attention}.{stage.name}", run=run,
                               reference=reference if stage.reference else None)


def _moe_stage(stage: Stage, run_stage: RunStage) -> Stage:
    def run(ctx, v):
        return run_stage(stage, moe_context(ctx), v)

    def reference(ctx, v):
        return stage.reference(moe_context(ctx), v)

    return dataclasses.replace(stage, name=f"moe.{stage.name}", run=run,
                               reference=reference if stage.reference else None)


def block_stages(case: BlockCase, run_stage: RunStage = default_run_stage, group=None) -> tuple[Stage, ...]:
    """The block's stages in order; `run_stage` runs each half's own stage, `group` is the
    rank's attention TP group (None for the golden's references)."""
    attention = half(case.attention).stages(case.model)
    moe = half("moe").stages(case.model)
    hand = dataclasses.replace(HAND_OFF, run=lambda ctx, v: run_stage(HAND_OFF, ctx, v))
    return (*(_attention_stage(s, case, run_stage, group) for s in attention), hand,
            *(_moe_stage(s, run_stage) for s in moe))


__all__ = ["ATTENTION_OUTPUT", "HAND_OFF", "MOE_RESIDUAL", "attention_context", "block_stages", "half", "hand_off",
           "moe_context"]
