"""The prefill layers judged against a whole-prompt golden with pools per rank (HCA's, CSA's):
the golden run once over the prompt, from the group's tensors in the reference's layout or,
in a launch, from every rank's x_hc gathered; each rank's x_out cut to its layout rows, its
pools as the golden committed them through the rank's own tables."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..contract.context import RankContext
from ..contract.tensors import Kind, TensorSpec
from ..distributed import wire
from . import golden as swa_golden
from .case import PrefillCase
from .layer import PrefillSWALayer


class WholePromptLayer(PrefillSWALayer):
    """A zigzag prefill layer whose golden is `prompt_golden` over the whole prompt."""

    compared: tuple[str, ...] = ()  # the outputs the golden gives, each stacked [cp, ...]
    # The layer's fixture and golden, as functions of the class: `weights(case)`,
    # `inputs(case, rank)` (every tensor of the rank) and `prompt_golden(case, ranks, prompt)`
    # (each of `ranks`' (its tensors) expected outputs from the prompt [total, HC, D], x_out whole).
    weights: Callable[[PrefillCase], dict[str, torch.Tensor]]
    inputs: Callable[[PrefillCase, int], dict[str, torch.Tensor]]
    prompt_golden: Callable[[PrefillCase, Sequence[Mapping[str, torch.Tensor]], torch.Tensor],
                            list[dict[str, torch.Tensor]]]

    def swa_specs(self, case: PrefillCase) -> tuple[dict[str, TensorSpec], TensorSpec]:
        """The SWA prefill's inputs (its `query_position_ids` under the compressed layers'
        reference name `query_positions`) and its x_out spec."""
        swa = PrefillSWALayer.tensor_specs(self, case)
        x_out = swa.pop("x_out")
        return {("query_positions" if n == "query_position_ids" else n): s for n, s in swa.items()}, x_out

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        built = self.inputs(case, rank)
        return {n: built[n] for n, s in self.tensor_specs(case).items() if s.kind is not Kind.OUTPUT}

    def full_o_weights(self, case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weights(case)
        return w["wo_a"], w["wo_b"]

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole prompt on one process from the group's tensors in the reference's layout
        (the per-rank ones stacked [cp, ...]); outputs stacked."""
        ranks = [self.of_rank(tensors, r) for r in range(case.cp)]
        prompt = swa_golden.prompt_of(case, torch.stack([r["x_hc"] for r in ranks]))
        outs = [self.rank_rows(case, r, o) for r, o in enumerate(self.prompt_golden(case, ranks, prompt))]
        return {n: torch.stack([o[n] for o in outs]) for n in self.compared}

    def rank_golden(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's x_hc gathered (the harness's all-gather), the whole prompt run once."""
        case = ctx.case
        prompt = swa_golden.prompt_of(case, wire.all_gather(tensors["x_hc"].contiguous(), ctx.group, case.cp))
        cpu = {n: t.cpu() for n, t in tensors.items()}
        return self.rank_rows(case, ctx.rank, self.prompt_golden(case, [cpu], prompt)[0])

    @staticmethod
    def rank_rows(case: PrefillCase, rank: int, out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A rank's golden: x_out cut to its layout rows, the pools as they are."""
        return {**out, "x_out": swa_golden.rank_slice(case, rank, out["x_out"]).flatten(0, 2)}

    def of_rank(self, stacked: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank's inputs from tensors in the reference's layout: per-rank ones sliced."""
        return {n: t if n in self.replicated_inputs else t[rank].clone() for n, t in stacked.items()}


def replicated(shape, dtype) -> TensorSpec:
    """An input held once in the reference's snapshot."""
    return TensorSpec(shape, dtype, Kind.INPUT, replicated=True)


def per_rank(shape, dtype, kind: Kind = Kind.INPUT) -> TensorSpec:
    """A tensor with the leading cp axis in the reference's snapshot."""
    return TensorSpec(shape, dtype, kind)


__all__ = ["WholePromptLayer", "replicated", "per_rank"]
