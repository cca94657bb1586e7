"""A stage list walked as the golden walks it: every stage by its `Stage.golden`, so a
cross-rank stage by its `reference` on every rank's inputs and never by the collective under test.

Two drivers of the same rule:

* `golden_stage` on one rank of a group: the stage's `every_rank` inputs gathered with the
  harness's own all-gather (raw bytes, bit-exact), then the stage's golden. A rank's golden
  is `run_stages(stages, ctx, tensors, golden_stage)`; bisect's golden chain is the same walk.
* `walk_group` on one process: the whole group at once from every rank's tensors, each stage
  run for each rank with its `every_rank` inputs stacked from every rank's values.

Both give the same bits: stacking and the all-gather move bytes only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ..contract.context import RankContext
from ..contract.stage import Stage
from . import wire


def _stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """Every rank's tensor stacked `[P, ...]`, or their list where their leading sizes differ
    (the MoE receive rows)."""
    return torch.stack(list(parts)) if len({tuple(t.shape) for t in parts}) == 1 else list(parts)


def every_rank(ctx: RankContext, t: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """Every rank's `t` on the CPU, bit-exact (raw bytes on the wire), as `_stacked` gives it."""
    t = t.detach().to(ctx.device)
    rows = wire.all_gather(torch.tensor([t.shape[0] if t.dim() else 0], device=ctx.device), ctx.group, ctx.tp)
    rows = rows.reshape(-1).tolist()
    if len(set(rows)) == 1:
        if t.numel() == 0:  # every rank's is as empty (no route anywhere): no bytes to move
            return t.new_empty((ctx.tp, *t.shape)).cpu()
        return wire.all_gather(t, ctx.group, ctx.tp).cpu()
    padded = t.new_zeros((max(rows), *t.shape[1:]))
    padded[: t.shape[0]] = t
    every = wire.all_gather(padded, ctx.group, ctx.tp).cpu()
    return [every[r, :n] for r, n in enumerate(rows)]


def golden_stage(stage: Stage, ctx: RankContext, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`stage` as the golden runs it on this rank (a `run_stages` runner), outputs on the CPU."""
    args = dict(values)
    for name in stage.every_rank:
        args[name] = every_rank(ctx, args[name])
    return {n: t.detach().to("cpu", copy=True) for n, t in stage.golden(ctx, args).items()}


def walk_group(stages: Sequence[Stage], ctx: RankContext, tensors: Sequence[Mapping[str, torch.Tensor]]) -> list[dict]:
    """Every rank's golden values on one process: `tensors[r]` is rank r's, `ctx` any rank's
    context of the case (no process group is used). Returns each rank's tensors and stage outputs."""
    values = [dict(t) for t in tensors]
    ranks = [dataclasses.replace(ctx, rank=r, group=None) for r in range(len(values))]
    for stage in stages:
        gathered = {n: _stacked([v[n] for v in values]) for n in stage.every_rank}
        produced = [stage.golden(rank, {**{n: v[n] for n in stage.reads}, **gathered}) for rank, v in zip(ranks, values)]
        for v, out in zip(values, produced):
            v.update(out)
    return values


__all__ = ["every_rank", "golden_stage", "walk_group"]
