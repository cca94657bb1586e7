"""A layer made of one stage list: its golden and its TP forward both walk that list.

`run_stages` runs a list on one rank: each stage gets the tensors it reads (the rank's own or
earlier stages' outputs) and adds what it writes. `StagedLayer` derives a layer's golden and
TP forward from its `stages(model)`:

* golden: the list on a single device (`RankContext.single_device`: tp = 1, so the group
  all-to-all and the reduce-scatter are identities) with the full O weights: the reference's
  TP1 golden of the rank's shard;
* forward: the list on the rank's TP group with its O-weight shards.

Both run the same stage objects, hence tp = 1 is bitwise the golden. An implementation that
replaces a stage passes `run_stage` (see `layers.tp.TorchTP.run_stage`); the harness observes
each stage through `RankContext.observe` (bisect records the outputs, benchmarks time them).

The check shorthands say how a stage's output is judged against the golden stage on the same
inputs: data movement bitwise; bf16 results within 1–2 ulps (rtol 1/128, validation.md §7);
fp32 results within 1e-4 relative.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence

import torch

from .case import Case
from .checks import AllcloseCheck, Check, ExactCheck, PoolCheck
from .config import ModelConfig
from .context import RankContext
from .layer import Layer
from .stage import Stage, StageOutput, Values

RunStage = Callable[[Stage, RankContext, Values], dict[str, torch.Tensor]]


def default_run_stage(stage: Stage, ctx: RankContext, values: Values) -> dict[str, torch.Tensor]:
    return stage.run(ctx, values)


def run_stages(
    stages: Sequence[Stage], ctx: RankContext, tensors: Mapping[str, torch.Tensor],
    run_stage: RunStage = default_run_stage,
) -> dict[str, torch.Tensor]:
    """Every stage in order on one rank; returns the tensors and every stage's outputs by name."""
    values = dict(tensors)
    for stage in stages:
        args = {n: values[n] for n in stage.reads}
        if ctx.observe is None:
            produced = run_stage(stage, ctx, args)
        else:
            produced = ctx.observe(stage, lambda stage=stage, args=args: run_stage(stage, ctx, args))
        values.update(produced)
    return values


class StagedLayer(Layer):
    """A layer whose golden and TP forward are its one stage list."""

    @abc.abstractmethod
    def stages(self, model: ModelConfig) -> tuple[Stage, ...]:
        """The layer's stages in the spec's order."""

    def golden(self, case: Case, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = next(iter(tensors.values())).device
        ctx = RankContext(case=case, rank=0, device=device).single_device()
        values = run_stages(self.stages(case.model), ctx, tensors)
        return {n: values[n] for n in self.compared_names(case)}

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        values = run_stages(self.stages(ctx.model), ctx, tensors, run_stage)
        return {n: values[n] for n in self.compared_names(ctx.case)}


# -- how a stage output is judged ---------------------------------------------------------------


def exact(name: str) -> ExactCheck:
    return ExactCheck(name)


def bf16_close(name: str, max_error_ratio: float = 0.005) -> AllcloseCheck:
    return AllcloseCheck(name, atol=1e-4, rtol=1 / 128, max_error_ratio=max_error_ratio)


def fp32_close(name: str) -> AllcloseCheck:
    return AllcloseCheck(name, atol=1e-5, rtol=1e-4)


def judged(check: Check, chain: Check | None = None) -> StageOutput:
    return StageOutput(check, chain)


def pool_written(check: PoolCheck) -> StageOutput:
    """A pool a stage writes: re-computed from the same inputs, every element within the
    layer's tolerance, stray writes included (budget 0); against the golden chain, the
    layer's own check."""
    return StageOutput(AllcloseCheck(check.output, atol=check.atol, rtol=check.rtol, max_error_ratio=0.0), check)


__all__ = ["RunStage", "default_run_stage", "run_stages", "StagedLayer", "exact", "bf16_close", "fp32_close",
           "judged", "pool_written"]
