"""Run a CP prefill group in one process: every rank's stages in lockstep, each exchange by
its reference data movement (the real collectives run in tests/distributed)."""

from __future__ import annotations

import torch

from layers.contract.context import RankContext
from layers.prefill import registry
from layers.prefill.case import PrefillCase


def run_group(case: PrefillCase, inputs: list[dict], stages=None) -> list[dict]:
    """Every rank's compared outputs; `stages`: in place of the case's layout's list."""
    layer = registry.of_case(case)
    stages = layer.stages(case.model) if stages is None else stages
    values = [dict(t) for t in inputs]
    for stage in stages:
        ctxs = [RankContext(case=case, rank=r, device=torch.device("cpu")) for r in range(case.cp)]
        if stage.reference is None:
            for r, ctx in enumerate(ctxs):
                values[r].update(stage.run(ctx, {n: values[r][n] for n in stage.reads}))
        else:
            every = {n: torch.stack([v[n] for v in values]) for n in stage.every_rank}
            for r, ctx in enumerate(ctxs):
                values[r].update(stage.reference(ctx, every))
    compared = [c.output for c in layer.checks(case)]
    return [{n: v[n] for n in compared} for v in values]
