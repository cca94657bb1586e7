"""Benchmark mode: time the implementation under test, round by round, on every rank.

After the validated step, each rank runs the implementation `warmup + rounds` more times on
the same inputs: the in-out tensors (caches, states) are restored from clones outside the
timed region, every rank of the group meets at a barrier before each round, and the device is
synchronised before and after (CUDA / NPU; nothing to do on the CPU), so a round's time is
execution, not kernel launches. Per round the slowest rank's time counts: that is when the
layer's step is done for the whole group.

With `stages=True` every stage a stage-based implementation runs (`layers.tp.TorchTP`, the
layer's stage list) is timed the same way, through the rank context's observer, so a report
shows where a round's time goes and the collectives apart from compute; an implementation that
is not stage-based is timed as a whole. With a profile path the timed rounds run under
`torch.profiler` (CPU activities, CUDA on a GPU, `torch_npu.profiler` on an NPU) and one
Chrome trace is written per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from launcher.config.spec import BenchSpec


def device_sync(device: torch.device) -> Callable[[], None]:
    """Waits for every kernel queued on `device` (a no-op on the CPU, which runs eagerly)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "npu":
        return lambda: torch.npu.synchronize(device)  # torch_npu registers torch.npu when imported
    return lambda: None


def _barrier(group) -> None:
    if group is None:
        return
    import torch.distributed as dist  # only a multi-rank run has a group

    dist.barrier(group=group)


@dataclass
class RankTimes:
    """One rank's benchmark: each timed round's wall seconds, and each stage's per round."""

    rounds_s: list[float]
    stages_s: dict[str, list[float]]  # stage name -> seconds per timed round (stage-based impls)
    collective_stages: list[str]  # the stages that move data between ranks


def run_rounds(impl, ctx, tensors: dict[str, torch.Tensor], pristine: Mapping[str, torch.Tensor], spec: BenchSpec,
               profile_path: str | None = None) -> RankTimes:
    """`spec.warmup + spec.rounds` calls of `impl(ctx, tensors)`; the in-out tensors named in
    `pristine` are restored before each call (outside the timed region)."""
    sync = device_sync(ctx.device)
    stage_s: dict[str, float] = {}
    collective: set[str] = set()

    def timed_stage(stage, run):
        sync()
        t0 = time.perf_counter()
        out = run()
        sync()
        stage_s[stage.name] = stage_s.get(stage.name, 0.0) + time.perf_counter() - t0
        if stage.every_rank:
            collective.add(stage.name)
        return out

    call_ctx = dataclasses.replace(ctx, observe=timed_stage) if spec.stages else ctx

    def one_round() -> float:
        for name, value in pristine.items():
            tensors[name].copy_(value)
        stage_s.clear()
        _barrier(ctx.group)
        sync()
        t0 = time.perf_counter()
        impl(call_ctx, tensors)
        sync()
        return time.perf_counter() - t0

    for _ in range(spec.warmup):
        one_round()
    rounds_s: list[float] = []
    stages_s: dict[str, list[float]] = {}
    with _profiler(ctx.device) if profile_path else contextlib.nullcontext() as profiler:
        for _ in range(spec.rounds):
            rounds_s.append(one_round())
            for name, s in stage_s.items():
                stages_s.setdefault(name, []).append(s)
    if profile_path:
        profiler.export_chrome_trace(profile_path)
    return RankTimes(rounds_s, stages_s, sorted(collective))


def _profiler(device: torch.device):
    if device.type == "npu":
        import torch_npu  # only an NPU run profiles with it

        return torch_npu.profiler.profile(activities=[torch_npu.profiler.ProfilerActivity.CPU,
                                                      torch_npu.profiler.ProfilerActivity.NPU])
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


# -- on rank 0: the figures of every rank's times ------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"min_s": min(values), "median_s": statistics.median(values), "mean_s": statistics.fmean(values),
            "max_s": max(values)}


def summarize(spec: BenchSpec, ranks: Sequence[RankTimes], rank_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """result.json's `bench`: the min / median / mean / max of each round's slowest rank, each
    rank's own figures, every round of every rank (`raw_s[round][rank]`), and with stage times
    each stage's median per rank and the median of its per-round slowest rank."""
    rank_ids = list(rank_ids) if rank_ids is not None else list(range(len(ranks)))
    raw = [[r.rounds_s[i] for r in ranks] for i in range(spec.rounds)]
    slowest = [max(row) for row in raw]
    bench = {"rounds": spec.rounds, "warmup": spec.warmup, **_stats(slowest),
             "per_rank": [{"rank": rid, **_stats(r.rounds_s)} for rid, r in zip(rank_ids, ranks)],
             "raw_s": raw}
    names = [n for n in ranks[0].stages_s] if ranks and all(r.stages_s for r in ranks) else []
    if names:
        collective = set().union(*(r.collective_stages for r in ranks))
        bench["stages"] = [
            {"stage": n, "collective": n in collective,
             "median_s": statistics.median(max(r.stages_s[n][i] for r in ranks) for i in range(spec.rounds)),
             "per_rank_median_s": [statistics.median(r.stages_s[n]) for r in ranks]}
            for n in names
        ]
    return bench


__all__ = ["RankTimes", "device_sync", "run_rounds", "summarize"]
