"""The fixture's O-projection weights: wo_a per output group, wo_b per group column block.

wo_b is quantized per row over all G·OL columns, so its scale is the full weight's on every
rank (never re-derived per shard). A layer names its two draws and its rounding
(`OWeightRecipe`); this module builds from them a rank's shard, streaming the blocks for the
row amax and keeping only the rank's own, the full weights the golden projects with, and a
shard sliced from full weights already built, so a rank that needs both draws them once.
All three give the bits of quantizing the whole wo_b at once (each layer's `stacked_inputs`
does that; tests compare).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .base import Kind, Layer
from .case import Case
from .numerics import f32, quant_weight_int8


@dataclass(frozen=True)
class OWeightRecipe:
    wo_a_group: Callable[[Case, int], torch.Tensor]  # (case, g) -> bf16 [OL, GI]
    wo_b_block: Callable[[Case, int], torch.Tensor]  # (case, g) -> bf16 [D, OL], before quantization
    half_away_from_zero: bool = False  # the quantizer's rounding (CSA); else half to even

    def build(self, case: Case, groups: range) -> dict[str, torch.Tensor]:
        """wo_a [len(groups), OL, GI], the int8 wo_b columns of `groups` [D, len(groups)·OL] and
        the full per-row wo_b_scale [D]. Every block is drawn (the amax spans the row), only
        the kept ones are held, and each is quantized with one extra column holding the row
        amax: the quantizer then sees the full row's amax, so every code is the full row's."""
        amax, kept = None, []
        for g in range(case.model.o_groups):
            block = self.wo_b_block(case, g)
            block_amax = f32(block).abs().amax(dim=1, keepdim=True)
            amax = block_amax if amax is None else torch.maximum(amax, block_amax)
            if g in groups:
                kept.append(block)
        codes, scale = [], None
        for block in kept:
            q, scale = quant_weight_int8(torch.cat((f32(block), amax), dim=1), axis=-1,
                                         half_away_from_zero=self.half_away_from_zero)
            codes.append(q[:, :-1])
        return {
            "wo_a": torch.stack([self.wo_a_group(case, g) for g in groups]),
            "wo_b": torch.cat(codes, dim=1),
            "wo_b_scale": scale,
        }

    def shard(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return self.build(case, own_groups(case, rank))

    def full(self, case: Case) -> dict[str, torch.Tensor]:
        return self.build(case, range(case.model.o_groups))

    def whole(self, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(wo_a, wo_b, wo_b_scale)` with wo_b quantized whole, as the reference does: the
        stacked fixtures' independent construction of what `full` streams."""
        groups = range(case.model.o_groups)
        wo_a = torch.stack([self.wo_a_group(case, g) for g in groups])
        wo_b, wo_b_scale = quant_weight_int8(torch.cat([self.wo_b_block(case, g) for g in groups], dim=1), axis=-1,
                                             half_away_from_zero=self.half_away_from_zero)
        return wo_a, wo_b, wo_b_scale


def own_groups(case: Case, rank: int) -> range:
    lg = case.local_o_groups
    return range(rank * lg, (rank + 1) * lg)


def shard_of(case: Case, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank r's shard of full O weights, as copies (the full weights can be freed after)."""
    groups, ol = own_groups(case, rank), case.model.o_lora_rank
    return {
        "wo_a": full["wo_a"][groups.start : groups.stop].clone(),
        "wo_b": full["wo_b"][:, groups.start * ol : groups.stop * ol].contiguous(),
        "wo_b_scale": full["wo_b_scale"].clone(),
    }


class LayerDrawingOWeights(Layer):
    """A layer whose fixture draws its O weights from `o_recipe`: `rank_inputs`,
    `full_o_weights` and `rank_inputs_and_full_o` from the recipe and `rank_inputs_without_o`."""

    o_recipe: ClassVar[OWeightRecipe]

    @abc.abstractmethod
    def rank_inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        """Every input and in-out tensor of rank r but wo_a / wo_b / wo_b_scale."""

    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return self._ordered(case, {**self.rank_inputs_without_o(case, rank), **self.o_recipe.shard(case, rank)})

    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        full = self.o_recipe.full(case)
        return full["wo_a"], full["wo_b"]

    def rank_inputs_and_full_o(self, case: Case, rank: int):
        full = self.o_recipe.full(case)
        inputs = self._ordered(case, {**self.rank_inputs_without_o(case, rank), **shard_of(case, rank, full)})
        return inputs, (full["wo_a"], full["wo_b"])

    def _ordered(self, case: Case, built: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: built[n] for n, spec in self.tensor_specs(case).items() if spec.kind is not Kind.OUTPUT}
