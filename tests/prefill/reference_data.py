"""A shipped reference-made CP prefill snapshot, read as the in-process prefill tests judge it."""

from __future__ import annotations

import torch

from layers.prefill.case import PrefillCase
from tests.conftest import reference_snapshot

from .group import run_group
from .judge import failures


class ReferencePrefill:
    """`prefill-<layer>-cp2-mini`: its tensors, the reference's outputs per rank (x_out as the
    layer's rows), and the failures of our golden's and our CP group's outputs against them."""

    def __init__(self, layer, case: PrefillCase) -> None:
        self.layer, self.case = layer, case
        folder = reference_snapshot(f"prefill-{case.layer}")
        self.inputs, self.outputs = ({p.stem: torch.load(p, weights_only=True) for p in sorted((folder / sub).glob("*.pt"))}
                                     for sub in ("in", "out"))

    def reference_outputs(self) -> list[dict[str, torch.Tensor]]:
        return [{n: self.outputs[n][r].flatten(0, 2) if n == "x_out" else self.outputs[n][r] for n in self.layer.compared}
                for r in range(self.case.cp)]

    def golden(self) -> list[dict[str, torch.Tensor]]:
        """Our golden's outputs per rank, from the snapshot's inputs."""
        got = self.layer.golden(self.case, {n: t.clone() for n, t in self.inputs.items()})
        return [{n: got[n][r] for n in self.layer.compared} for r in range(self.case.cp)]

    def group_failures(self, profiles, ours: list[dict]) -> list:
        """(profile, rank, tensor) of every output of our golden (`ours`) and of our CP group
        that a profile's checks fail on the reference's outputs."""
        expected = self.reference_outputs()
        group = run_group(self.case, [self.layer.of_rank(self.inputs, r) for r in range(self.case.cp)])
        return [(i, *bad) for i, checks in enumerate(profiles) for outs in (ours, group)
                for bad in failures(checks, outs, expected)]
