"""Judge a CP prefill group's outputs against the golden with the layer's comparators; the
whole-prompt layers' tiny cases run in one process."""

from __future__ import annotations

import torch

from launcher.verify.build import build_compare_fn, compare_outputs
from layers.contract.config import TINY
from layers.prefill import fixture, registry
from layers.prefill.case import PrefillCase

from .group import run_group


def failures(checks, outputs: list[dict], expected: list[dict]) -> list[tuple[int, str]]:
    """(rank, tensor) of every failing output."""
    fn = build_compare_fn(checks, mapping_shape=(), leading_rank_axis=False)
    bad = []
    for rank, (got, want) in enumerate(zip(outputs, expected)):
        for name, verdict in compare_outputs(got, want, compare_fn=fn).items():
            if not verdict.passed:
                bad.append((rank, name))
    return bad


class WholePromptCases:
    """A whole-prompt prefill layer's tiny cases in one process (HCA's, CSA's): each seed's
    weights drawn once, every rank's inputs, the golden cut per rank, and a group's failures."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self._weights: dict[int, dict] = {}

    def case(self, cp: int = 2, **keys) -> PrefillCase:
        return PrefillCase(self.layer.name, TINY, cp, 7, **keys)

    def weights(self, seed: int) -> dict:
        if seed not in self._weights:
            self._weights[seed] = self.layer.weights(PrefillCase(self.layer.name, TINY, 1, seed))
        return self._weights[seed]

    def inputs(self, case: PrefillCase) -> list[dict]:
        return [self.layer.inputs(case, r, self.weights(case.seed)) for r in range(case.cp)]

    def expected(self, case: PrefillCase, inputs: list[dict]) -> list[dict]:
        outs = self.layer.prompt_golden(case, inputs, fixture.whole_prompt(case))
        return [self.layer.rank_rows(case, r, o) for r, o in enumerate(outs)]

    def run(self, case: PrefillCase, stages=None) -> list[tuple[int, str]]:
        """(rank, tensor) of every output of the group (its stages, or `stages`) the golden fails."""
        self.layer.validate(case)
        inputs = self.inputs(case)
        return failures(self.layer.checks(case), run_group(case, inputs, stages), self.expected(case, inputs))

    def stacked_golden_mismatches(self, case: PrefillCase) -> list[tuple[int, str]]:
        """(rank, tensor) where the golden from tensors in the reference's snapshot layout (the
        per-rank ones stacked, the replicated ones once) differs from the rank's own."""
        inputs = self.inputs(case)
        stacked = {n: inputs[0][n] if n in self.layer.replicated_inputs else torch.stack([t[n] for t in inputs])
                   for n in inputs[0]}
        got = self.layer.golden(case, stacked)
        return [(r, name) for r, want in enumerate(self.expected(case, inputs)) for name in self.layer.compared
                if not torch.equal(got[name][r], want[name])]


def scope_failures(case: PrefillCase, outputs: list[dict]) -> list[tuple[int, str]]:
    """(rank, tensor) of every exchange output (`scope=collectives`) its scope's golden fails."""
    scope = registry.of_case(case)
    expected = [scope.golden(case, scope.rank_inputs(case, r)) for r in range(case.cp)]
    return failures(scope.checks(case), outputs, expected)
