"""The SWA CP prefill layer: forward on a rank, the golden of a rank, inputs from a snapshot.

`forward` walks `swa.stages()` on the rank's CP group; `golden` is the independent
whole-prompt golden (`golden.whole_prompt`) cut to the rank; `from_reference` turns the
reference's rank-stacked tensors (`in/<name>.pt` of a snapshot) into one rank's inputs,
with this project's tables built from the case (their reference counterparts are checked
equal by the tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..contract.context import RankContext
from ..contract.stage import Stage
from ..staged import RunStage, default_run_stage, run_stages
from . import fixture, golden as golden_math, swa
from .case import PrefillCase

COMPARED = ("kv_cache", "x_out")


def forward(ctx: RankContext, tensors: Mapping[str, torch.Tensor], stages: Sequence[Stage] | None = None,
            run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
    values = run_stages(swa.stages() if stages is None else stages, ctx, tensors, run_stage)
    return {n: values[n] for n in COMPARED}


def golden(case: PrefillCase, rank: int, prompt: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> dict:
    """Rank's expected kv_cache and x_out from the whole prompt [total, HC, D] and the rank's
    (replicated) weights and initial cache."""
    x_out, _, final = golden_math.whole_prompt(case, tensors, prompt, tensors["kv_cache"])
    return {"kv_cache": final, "x_out": golden_math.rank_slice(case, rank, x_out)}


def from_reference(case: PrefillCase, stacked: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank's inputs from the reference's rank-stacked tensors (weights are replicated there)."""
    own = {n: stacked[n] for n in (*fixture.WEIGHTS, "freqs_cos", "freqs_sin")}
    return {**own, "x_hc": stacked["x_hc"][rank], "kv_cache": stacked["kv_cache"][rank].clone(),
            **fixture.rank_tables(case, rank)}


__all__ = ["COMPARED", "forward", "golden", "from_reference"]
