"""Who judges which compared tensor: each check of the layer whole, on a rank of its own.

A check's comparator needs every rank's shard of its tensor side by side (the reference's
budgets are pooled over the ranks). Rather than gather every tensor to rank 0 and judge the
checks there one after another while the other ranks wait, the checks are dealt out over the
world (`plan`: the largest first, each to the rank given the fewest bytes so far; the same
plan on every rank, since it depends on the tensors' specs alone). Every rank sends its
shards of a check's tensors (the output, each reference's, and the context the check reads:
its slot mapping and its pre-step value) to the check's judge, every message at once
(`send_to_judges`); each judge runs the check's comparator and integrity checks on the
stacked tensors of every group (`judge`: the code rank 0 ran on the same tensors, so the same
verdicts), and rank 0 puts the verdicts back in the layer's check order (`collect`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

import torch

from layers.contract.checks import Check, PoolCheck
from layers.contract.tensors import TensorSpec
from layers.distributed import wire

from launcher.run.groups import GroupLayout
from launcher.verify import where
from launcher.verify.base import initial_key
from launcher.verify.build import build_comparator
from launcher.verify.integrity import integrity_checks


@dataclasses.dataclass(frozen=True)
class Assignment:
    index: int  # the check's place in the layer's validation order
    output: str  # the compared tensor
    context: tuple[str, ...]  # the context tensors the check reads besides the outputs
    judge: int  # the global rank that judges it


def context_of(check: Check, context_names: Collection[str]) -> tuple[str, ...]:
    """What a check reads besides its tensor (`judge_check`'s `inputs`): a pool's slot mapping,
    and the tensor's value before the step (which side wrote a stray row)."""
    names = [check.mapping] if isinstance(check, PoolCheck) else []
    names.append(initial_key(check.output))
    return tuple(n for n in names if n in context_names)


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def plan(checks: Sequence[Check], context_names: Collection[str], specs: Mapping[str, TensorSpec],
         references: int, world: int) -> list[Assignment]:
    """Each check's judge: the checks by falling bytes (the output once per side, its context
    once), each to the rank with the fewest bytes so far (the lowest such rank on a tie)."""
    def spec_of(name: str) -> TensorSpec:
        return specs[name.removeprefix(initial_key(""))]

    sized = []
    for index, check in enumerate(checks):
        context = context_of(check, context_names)
        size = (1 + references) * _nbytes(specs[check.output]) + sum(_nbytes(spec_of(n)) for n in context)
        sized.append((size, index, check, context))
    load = [0] * world
    judges = {}
    for size, index, check, context in sorted(sized, key=lambda s: (-s[0], s[1])):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += size
        judges[index] = Assignment(index, check.output, context, rank)
    return [judges[i] for i in range(len(checks))]


def send_to_judges(assignments: Sequence[Assignment], actual: Mapping[str, torch.Tensor],
                   references: Mapping[str, Mapping[str, torch.Tensor]], context: Mapping[str, torch.Tensor],
                   rank: int, world: int, device: torch.device) -> dict[int, tuple[dict, dict, dict]]:
    """This rank's shards of every check's tensors to the check's judge (over the world group,
    from `device`); what this rank judges, stacked `[world, ...]` on the CPU:
    {index: (actual, {reference: expected}, context)}."""
    messages = []  # (check, side, tensor name, this rank's shard)
    for a in assignments:
        messages.append((a, "actual", a.output, actual[a.output]))
        messages += [(a, source, a.output, reference[a.output]) for source, reference in references.items()]
        messages += [(a, "context", name, context[name]) for name in a.context]
    # One tensor on the device at a time where the backend gathers one after another.
    sends = ((t.detach().to(device), a.judge) for a, _, _, t in messages)
    held: dict[int, tuple[dict, dict, dict]] = {a.index: ({}, {}, {}) for a in assignments if a.judge == rank}
    for (a, side, name, _), stacked in zip(messages, wire.gather_each(sends, rank, world)):
        if stacked is None:
            continue
        mine, expected, ctx = held[a.index]
        if side == "actual":
            mine[name] = stacked
        elif side == "context":
            ctx[name] = stacked
        else:
            expected.setdefault(side, {})[name] = stacked
    return held


def judge_check(case, tolerances, default: Check, actual: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor],
                context: Mapping[str, torch.Tensor], integrity_on: bool) -> tuple[dict, list[dict]]:
    """`(verdict, integrity checks)` of one check of the layer on one group's stacked `[size, ...]`
    tensors, with the run's tolerances (a diagnostic check is judged and reported, and never
    fails the run), and the integrity checks beside it (none when `integrity_on` is False)."""
    inputs = dict(context)  # the slot mapping and, under initial_key(name), the pre-step pool
    inputs["local_t"] = torch.tensor(case.local_t, dtype=torch.int32)
    check, overridden = tolerances.apply(default)
    a, e = actual[check.output], golden[check.output]
    cmp = build_comparator(check, mapping_shape=(case.group_size, case.local_t), leading_rank_axis=True)
    v = cmp.evaluate(a, e, inputs=inputs, actual_outputs=actual, expected_outputs=golden)
    diagnostic = check.output in tolerances.diagnostic
    verdict = {"tensor": check.output, **v.to_dict(), "diagnostic": diagnostic, "overridden": overridden}
    found = integrity_checks(check, a, e, inputs, diagnostic) if integrity_on else []
    if not v.passed or not all(c.passed for c in found):
        # where the errors are: per rank x row block / head group / page
        verdict["where"] = where.error_maps(check.output, check, a, e, inputs, seq=case.seq)
    verdict["tally"] = where.tally(verdict, check, a.shape)
    return verdict, [c.to_dict() for c in found]


def judge(held: Mapping[int, tuple[dict, dict, dict]], cases: Sequence, checks_of, tolerances, layout: GroupLayout,
          integrity_on: bool) -> list[tuple[int, str, int, dict, list[dict]]]:
    """Every check this rank holds, for every group (`cases[g]`, its checks `checks_of(case)`)
    and reference: `(group, reference, index, verdict, integrity checks)`."""
    judged = []
    for index, (actual, expected, context) in sorted(held.items()):
        for g, case in enumerate(cases):
            rows = slice(g * layout.tp, (g + 1) * layout.tp)
            default = checks_of(case)[index]
            mine = {n: t[rows] for n, t in actual.items()}
            ctx = {n: t[rows] for n, t in context.items()}
            for source, golden in expected.items():
                verdict, found = judge_check(case, tolerances, default, mine, {n: t[rows] for n, t in golden.items()},
                                             ctx, integrity_on)
                judged.append((g, source, index, verdict, found))
    return judged


def collect(judged_by_rank: Sequence[Sequence[tuple]], groups: int, sources: Sequence[str],
            integrity_on: bool) -> tuple[list[dict], list[dict | None]]:
    """Rank 0: every rank's `judge` answers as `(comparisons, integrity)`, one entry per group:
    {reference: verdicts in check order}, {reference: integrity checks in check order} (None
    when `integrity_on` is False)."""
    ordered = sorted((entry for judged in judged_by_rank for entry in judged), key=lambda entry: entry[:3])
    comparisons = [{source: [] for source in sources} for _ in range(groups)]
    integrity = [{source: [] for source in sources} if integrity_on else None for _ in range(groups)]
    for g, source, _, verdict, found in ordered:
        comparisons[g][source].append(verdict)
        if integrity_on:
            integrity[g][source] += found
    return comparisons, integrity


__all__ = ["Assignment", "collect", "context_of", "judge", "judge_check", "plan", "send_to_judges"]
