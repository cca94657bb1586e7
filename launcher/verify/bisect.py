"""Bisect: re-run a failing full-layer case stage by stage and name the first divergent stage and rank.

Runs inside every rank after the full run's comparison failed (validation.md §7: compare the
intermediates in dependency order and blame the first stage whose error blows up):

1. The golden chain: the layer's stage list (`layers.stages`) on clones of the rank's inputs.
   Cross-rank stages read every rank's golden inputs through an all-gather here and apply
   swa.md §5.3 / §5.5's index maps, or moe.md §4.4 / §3.2's replay (`Stage.reference`), so
   the golden never runs the collectives under test.
2. The implementation, called as in the full run (`impl(ctx, tensors)`) with a context that
   observes stages: a stage-based implementation (`layers.tp.TorchTP` and its subclasses, a
   stage they replace included) reports each stage's outputs as it runs it. Any other
   implementation takes part by adding intermediates to the dict it returns, under the stage
   tensor names (`layers.stages.stage_tensors`); the compared outputs (the pools, x_out)
   always count as their stages' outputs.
3. Each stage is judged in isolation: the golden stage re-run on the implementation's own inputs
   to that stage (its earlier outputs, or the rank's initial tensors) against the
   implementation's outputs, with the stage's check. A stage whose inputs were not exposed is
   judged against the golden chain instead (`chain_check`). Every stage also reports its
   distance to the golden chain. A last pseudo-stage `outputs` checks that the tensors the
   implementation returned are bitwise the ones its last stages computed.

`bisect_rank` returns one rank's table (JSON-ready); `gather_bisect` merges them on rank 0 into
{diverged, stage, rank, ranks, tensor, mode, label, figures, detail, stages}; `render` prints it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from layers.contract.checks import ExactCheck
from layers.contract.context import RankContext
from layers.contract.layer import Layer
from layers.contract.stage import Stage
from layers.distributed.golden_walk import golden_stage
from layers.stages import layer_stages

from launcher.verify.base import initial_key
from launcher.verify.build import build_comparator

OUTPUTS_STAGE = "outputs"


def golden_chain(stages: Sequence[Stage], ctx: RankContext, initial: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Stage name -> the golden's outputs of that stage, each stage fed the golden's earlier ones."""
    values = {n: t.clone() for n, t in initial.items()}
    chain = {}
    for stage in stages:
        chain[stage.name] = golden_stage(stage, ctx, {n: values[n] for n in stage.reads})
        values.update(chain[stage.name])
    return chain


def _run_impl(stages: Sequence[Stage], ctx: RankContext, inputs: dict, impl) -> tuple[dict, dict, bool]:
    """`(returned outputs, stage -> recorded outputs, whether stages were observed)` on CPU.

    A stage-based implementation (`layers.tp.TorchTP` and its subclasses, or any code that
    runs stages with `layers.contract.staged.run_stages`) reports each stage it runs through the
    context's observer: its outputs are recorded as it computed them, a replaced stage's
    included."""
    tensors = {n: t.to(ctx.device, copy=True) for n, t in inputs.items()}
    record: dict[str, dict[str, torch.Tensor]] = {}

    def observe(stage: Stage, run):
        produced = run()
        record[stage.name] = {n: t.detach().to("cpu", copy=True) for n, t in produced.items()}
        return produced

    returned = impl(dataclasses.replace(ctx, observe=observe), tensors)
    returned = {n: t.detach().to("cpu", copy=True) for n, t in returned.items() if isinstance(t, torch.Tensor)}
    staged = bool(record)
    if not staged:  # the implementation's own intermediates, by the stage tensor names
        for stage in stages:
            record[stage.name] = {n: returned[n] for n in stage.output_names if n in returned}
    return returned, record, staged


def _agree(ctx: RankContext, flags: list[bool]) -> list[bool]:
    """A flag holds only where it holds on every rank (a cross-rank golden runs on all or none)."""
    if ctx.tp == 1 or not flags:
        return flags
    import torch.distributed as dist

    t = torch.tensor(flags, dtype=torch.int32, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.group)
    return [bool(v) for v in t.cpu().tolist()]


def _distance(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """How far a tensor is from the golden chain's: bitwise?, max |diff| (finite points), #differing."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return {"comparable": False, "shape": list(actual.shape), "expected_shape": list(expected.shape),
                "dtype": str(actual.dtype), "expected_dtype": str(expected.dtype)}
    bitwise = torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    a, e = actual.double(), expected.double()
    finite = torch.isfinite(a) & torch.isfinite(e)
    differ = (a != e) & ~(torch.isnan(a) & torch.isnan(e))
    diff = torch.where(finite, (a - e).abs(), 0.0)
    return {"comparable": True, "bitwise": bitwise, "n_differ": int(differ.sum()), "numel": a.numel(),
            "max_abs_diff": float(diff.max()) if a.numel() else 0.0}


def _judge(check, actual: torch.Tensor, expected: torch.Tensor, ctx: RankContext, inputs: dict,
           actual_outputs: dict | None = None, expected_outputs: dict | None = None) -> dict[str, Any]:
    """One stage output's verdict; the stage's other outputs are the comparator's context (the
    MoE weights are ordered by their indices)."""
    cmp = build_comparator(check, mapping_shape=(ctx.case.local_t,), leading_rank_axis=False)
    v = cmp.evaluate(actual, expected, inputs=inputs, actual_outputs=actual_outputs, expected_outputs=expected_outputs)
    return {"passed": v.passed, "label": v.label, "kind": v.kind, "detail": v.detail, "figures": v.figures}


def bisect_rank(layer: Layer, ctx: RankContext, inputs: dict[str, torch.Tensor], impl) -> dict[str, Any]:
    """This rank's stage table; every rank must call it (the cross-rank goldens are collective).

    `inputs`: the rank's fresh inputs (before any step ran), as the full run got them.
    """
    stages = layer_stages(ctx.case)
    initial = {n: t.detach().to("cpu", copy=True) for n, t in inputs.items()}
    chain = golden_chain(stages, ctx, initial)
    returned, record, staged = _run_impl(stages, ctx, inputs, impl)
    # The comparators' context: the rank's inputs, and every pool as it was before the step.
    judge_inputs = {**initial, **{initial_key(n): t for n, t in initial.items()}}

    # Which stages can be re-run on the implementation's own inputs (decided before any runs,
    # so that every rank runs the same cross-rank goldens).
    seen, plans = dict(initial), []
    for stage in stages:
        got = record.get(stage.name, {})
        args = {n: seen[n] for n in stage.reads} if all(n in seen for n in stage.reads) else None
        plans.append((got, args))
        for name in stage.output_names:  # a stale initial value must not stand in for an output
            if name in got:
                seen[name] = got[name]
            else:
                seen.pop(name, None)
    isolated = _agree(ctx, [bool(got) and args is not None for got, args in plans])

    rows = []
    for stage, (got, args), alone in zip(stages, plans, isolated):
        reference = golden_stage(stage, ctx, {n: t.clone() for n, t in args.items()}) if alone else None
        mode = "isolated" if alone else ("chain" if got else "absent")
        tensors = []
        for out in stage.writes:
            name = out.name
            if name not in got:
                tensors.append({"tensor": name, "passed": None, "exposed": False})
                continue
            if alone:
                verdict = _judge(out.check, got[name], reference[name], ctx, judge_inputs, got, reference)
            else:
                verdict = _judge(out.chain_check or out.check, got[name], chain[stage.name][name], ctx, judge_inputs,
                                 got, chain[stage.name])
            tensors.append({"tensor": name, **verdict, "chain": _distance(got[name], chain[stage.name][name])})
        judged = [t["passed"] for t in tensors if t["passed"] is not None]
        rows.append({"stage": stage.name, "mode": mode, "passed": all(judged) if judged else None, "tensors": tensors})

    if staged:
        last = {n: vals[n] for vals in record.values() for n in vals}  # the latest stage value of each name
        tensors = [
            {"tensor": n, **_judge(ExactCheck(n), returned[n], last[n], ctx, judge_inputs), "chain": None}
            for n in layer.compared_names(ctx.case)
        ]
        rows.append({"stage": OUTPUTS_STAGE, "mode": "isolated", "passed": all(t["passed"] for t in tensors),
                     "tensors": tensors})
    return {"rank": ctx.rank, "staged_forward": staged, "stages": rows}


def _first_failing_output(cell: dict[str, Any]) -> int:
    """Where a rank's first failing output is in its stage's list. A cross-rank stage lists what
    a rank sends before what it receives (the MoE dispatch), so ordering the failing ranks by it
    names the rank a bad route came from before the ranks it reached."""
    return next(i for i, t in enumerate(cell["tensors"]) if t["passed"] is False)


def merge(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from every rank's table: the first stage (in order) failing on any rank."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    names = [s["stage"] for s in max(per_rank, key=lambda r: len(r["stages"]))["stages"]]
    table, first = [], None
    for i, name in enumerate(names):
        cells = [(r["rank"], r["stages"][i]) for r in per_rank if i < len(r["stages"])]
        failed = [rank for rank, cell in cells if cell["passed"] is False]
        judged = [cell["passed"] for _, cell in cells if cell["passed"] is not None]
        table.append({
            "stage": name,
            "modes": [cell["mode"] for _, cell in cells],
            "passed": all(judged) if judged else None,
            "failed_ranks": failed,
            "per_rank": [{"rank": rank, **cell} for rank, cell in cells],
        })
        if failed and first is None:
            by_rank = dict(cells)
            blamed = min(failed, key=lambda rank: (_first_failing_output(by_rank[rank]), rank))
            first = (name, blamed, failed, by_rank[blamed])
    report: dict[str, Any] = {
        "diverged": first is not None,
        "stage": None, "rank": None, "ranks": [], "tensor": None, "mode": None, "label": None, "figures": None,
        "detail": "",
        "staged_forward_ranks": [r["rank"] for r in per_rank if r["staged_forward"]],
        "stages": table,
    }  # fmt: skip
    if first is not None:
        name, blamed, failed, cell = first
        bad = next(t for t in cell["tensors"] if t["passed"] is False)
        report.update(stage=name, rank=blamed, ranks=failed, tensor=bad["tensor"], mode=cell["mode"],
                      label=bad["label"], figures=bad["figures"], detail=bad["detail"])
    return report


def gather_bisect(ctx: RankContext, result: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's `bisect_rank` result merged on the TP group's rank 0 (None on the others)."""
    if ctx.tp == 1:
        return merge([result])
    import torch.distributed as dist

    gathered = [None] * ctx.tp if ctx.rank == 0 else None
    dist.gather_object(result, gathered, dst=dist.get_global_rank(ctx.group, 0), group=ctx.group)
    return merge(gathered) if ctx.rank == 0 else None


_MODE_TEXT = {
    "isolated": "the stage re-run by the golden on the implementation's own inputs",
    "chain": "against the golden chain (the implementation did not expose this stage's inputs)",
}


def render(report: dict[str, Any]) -> str:
    """The report's text: the verdict, the failing check's detail, one line per stage."""
    if report["diverged"]:
        ranks = ", ".join(str(r) for r in report["ranks"])
        lines = [
            f"bisect: first divergence at stage '{report['stage']}' on rank {report['rank']} (ranks {ranks}), "
            f"tensor {report['tensor']}: {report['label']}, {_MODE_TEXT[report['mode']]}",
            *([report["detail"]] if report["detail"] else []),
        ]
    else:
        lines = ["bisect: no stage diverges in the staged re-run (the failure did not reproduce: a fault the "
                 "worker injected, a nondeterministic implementation, or inputs that differ from the fixture)"]
    lines.append(f"  {'stage':<18} {'result':<8} {'modes':<22} max |diff| to the golden chain, by rank")
    for row in report["stages"]:
        result = {True: "pass", False: "FAIL", None: "-"}[row["passed"]]
        modes = ",".join(sorted(set(row["modes"])))
        dists = []
        for cell in row["per_rank"]:
            chains = [t["chain"] for t in cell["tensors"] if t.get("chain")]
            if not chains:
                dists.append("-")
            elif all(c.get("bitwise") for c in chains):
                dists.append("0")
            else:
                dists.append(f"{max(c.get('max_abs_diff', float('nan')) for c in chains):.3g}")
        fails = f"  failing ranks {row['failed_ranks']}" if row["failed_ranks"] else ""
        lines.append(f"  {row['stage']:<18} {result:<8} {modes:<22} {' '.join(dists)}{fails}")
    return "\n".join(lines)


__all__ = ["OUTPUTS_STAGE", "golden_chain", "bisect_rank", "gather_bisect", "merge", "render"]
