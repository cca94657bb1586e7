"""The decoder layer `layer=block`: an attention layer in TP groups, then the MoE over the world.

One rank's step walks one stage list (`layers.block.stages`): its attention layer's own stages
on its TP group's context, the hand-off (the rank's attention output rows become its first MoE
tokens), then the MoE layer's own stages on the world's context. Each half is the layer package's own
`LAYER` (`layers.block.stages.HALVES`) reached through its `StagedLayer` API, so both keep one
copy of their math; a `run_stage` passed in (`layers.tp.TorchTP`) sees every stage of either half with
that half's context (`ctx.case.layer` names the half).

Bisect and the stage benchmark walk the same list, each stage named by its half. The golden
composes the halves' goldens the same way: per rank the attention golden of its TP group's
case (the single-device layer with the group's full O weights, as an attention launch
computes it), the hand-off, then the MoE golden the world computes together.

Compared: the MoE's `x_next` of every rank (the reference decode_layer's reldiff 0.01 /
0.05) and every cache the attention mutates, by the attention layer's own checks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..contract.checks import Check, RelDiffCheck
from ..contract.config import ConfigError
from ..contract.context import RankContext
from ..contract.layer import Layer
from ..contract.stage import Stage, Values
from ..contract.tensors import Kind, TensorSpec
from ..contract.staged import RunStage, default_run_stage, run_stages
from .case import BlockCase
from .stages import ATTENTION_OUTPUT, MOE_RESIDUAL, block_stages, half, hand_off, moe_context
from .tp_groups import attention_group

X_NEXT = RelDiffCheck("x_next", diff_thd=0.01, pct_thd=0.05, max_diff_hd=float("inf"))


class BlockLayer(Layer):
    name = "block"
    sharded_o_weights = False  # the attention golden draws its group's full O weights itself

    @property
    def replicated_inputs(self) -> frozenset[str]:
        """The MoE's: the attention weights differ between TP groups."""
        return half("moe").replicated_inputs

    def validate(self, case: BlockCase) -> None:
        attention = half(case.attention)
        for g in range(case.tp_groups):
            attention.validate(case.attention_case(g))
        half("moe").validate(case.moe_case())

    def _halves(self, case: BlockCase) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
        return half(case.attention).tensor_specs(case.attention_case(0)), half("moe").tensor_specs(case.moe_case())

    def tensor_specs(self, case: BlockCase) -> dict[str, TensorSpec]:
        """The attention's tensors but its output, then the MoE's with its x_hc renamed."""
        attention, moe = self._halves(case)
        specs = {n: s for n, s in attention.items() if n != ATTENTION_OUTPUT}
        specs.update({MOE_RESIDUAL if n == "x_hc" else n: s for n, s in moe.items()})
        return specs

    def rank_inputs(self, case: BlockCase, rank: int) -> dict[str, torch.Tensor]:
        """The attention fixture of rank `rank`'s TP group and rank in it, the MoE's of `rank`."""
        g = case.tp_group_of(rank)
        built = half(case.attention).rank_inputs(case.attention_case(g), rank % case.tp)
        moe = half("moe").rank_inputs(case.moe_case(), rank)
        built.update({MOE_RESIDUAL if n == "x_hc" else n: t for n, t in moe.items()})
        return {n: built[n] for n, s in self.tensor_specs(case).items() if s.kind is not Kind.OUTPUT}

    def full_o_weights(self, case):
        raise ConfigError("layer=block draws each TP group's O weights in its attention golden")

    def golden(self, case: BlockCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoder layer on one process from the world's tensors stacked [ep, ...]: each
        rank's attention golden (its TP group's case, full O weights), the hand-off, then the
        MoE golden over the world; outputs stacked so."""
        attention = half(case.attention)
        attention_outs, moe_ranks = [], []
        for r in range(case.ep):
            mine = {n: (x if x.dim() == 0 else x[r]).clone() for n, x in tensors.items()}
            attention_case = case.attention_case(case.tp_group_of(r))
            attention_in, moe_in = self._split(case, mine)
            attention_in["wo_a"], attention_in["wo_b"] = attention.full_o_weights(attention_case)
            out = attention.golden(attention_case, attention_in)
            attention_outs.append(out)
            moe_ranks.append({**moe_in, **hand_off(None, {ATTENTION_OUTPUT: out[ATTENTION_OUTPUT],
                                                          MOE_RESIDUAL: mine[MOE_RESIDUAL]})})
        moe_stacked = {n: torch.stack([m[n] for m in moe_ranks]) for n in moe_ranks[0]}
        x_next = half("moe").golden(case.moe_case(), moe_stacked)["x_next"]
        outs = [self._outputs(case, attention_outs[r], x_next[r]) for r in range(case.ep)]
        return {n: torch.stack([o[n] for o in outs]) for n in outs[0]}

    def _split(self, case: BlockCase, tensors: Mapping[str, torch.Tensor]):
        attention, moe = self._halves(case)
        attention_in = {n: tensors[n] for n, s in attention.items() if s.kind is not Kind.OUTPUT}
        moe_in = {n: tensors[n] for n, s in moe.items() if s.kind is not Kind.OUTPUT and n != "x_hc"}
        return attention_in, moe_in

    def _outputs(self, case: BlockCase, attention_values: Values, x_next: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**{n: attention_values[n] for n in self.compared_names(case) if n != "x_next"}, "x_next": x_next}

    def rank_golden(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The attention golden of this rank (its TP group's case and full O weights), the
        hand-off, then the MoE golden of the world (the harness's collectives)."""
        case: BlockCase = ctx.case
        attention = half(case.attention)
        attention_case = case.attention_case(case.tp_group_of(ctx.rank))
        attention_in, moe_in = self._split(case, tensors)
        attention_in["wo_a"], attention_in["wo_b"] = attention.full_o_weights(attention_case)
        attention_out = attention.golden(attention_case, attention_in)
        handed = hand_off(ctx, {ATTENTION_OUTPUT: attention_out[ATTENTION_OUTPUT], MOE_RESIDUAL: tensors[MOE_RESIDUAL]})
        x_next = half("moe").rank_golden(moe_context(ctx), {**moe_in, **handed})["x_next"]
        return self._outputs(case, attention_out, x_next)

    def case_stages(self, case: BlockCase) -> tuple[Stage, ...]:
        """The block's stage list (`layers.stages.layer_stages` of a block case)."""
        return block_stages(case)

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        """The attention stages on the rank's TP group, the hand-off, the MoE stages on the world."""
        case: BlockCase = ctx.case
        with attention_group(ctx) as group:
            values = run_stages(block_stages(case, run_stage, group), ctx, tensors)
        return {n: values[n] for n in self.compared_names(case)}

    def checks(self, case: BlockCase) -> tuple[Check, ...]:
        """The attention's cache checks (its x_out is the MoE's input, not an output), then x_next."""
        cached = tuple(c for c in half(case.attention).checks(case.attention_case(0)) if c.output != ATTENTION_OUTPUT)
        return (*cached, X_NEXT)


LAYER = BlockLayer()

__all__ = ["BlockLayer", "LAYER"]
