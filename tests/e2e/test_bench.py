"""Benchmark mode (`bench.rounds`, `bench.stages`, `golden=false`, `profile=true`): the figures
come from every rank's rounds, the in-out tensors are restored between rounds, and a slower
implementation or rank shows where it should."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from launcher.config.spec import BenchSpec
from launcher.report.console import bench_lines
from launcher.run.bench_rounds import RankTimes, run_rounds, summarize
from layers.contract.case import Case
from layers.contract.config import TINY
from layers.contract.context import RankContext
from layers.registry import get_layer
from layers.tp import TorchTP

from ..conftest import multirun


def test_figures_are_the_raw_rounds_exactly():
    a = RankTimes([0.5, 0.1, 0.3], {}, [])
    b = RankTimes([0.2, 0.4, 0.35], {}, [])
    bench = summarize(BenchSpec(rounds=3, warmup=2), [a, b])
    assert bench["raw_s"] == [[0.5, 0.2], [0.1, 0.4], [0.3, 0.35]]
    slowest = [0.5, 0.4, 0.35]  # each round's slowest rank
    assert (bench["min_s"], bench["max_s"]) == (0.35, 0.5)
    assert bench["median_s"] == statistics.median(slowest) and bench["mean_s"] == statistics.fmean(slowest)
    assert bench["per_rank"][1] == {"rank": 1, "min_s": 0.2, "median_s": 0.35, "mean_s": statistics.fmean([0.2, 0.4, 0.35]),
                                    "max_s": 0.4}
    assert (bench["rounds"], bench["warmup"]) == (3, 2) and "stages" not in bench


def test_stage_figures_take_each_rounds_slowest_rank():
    a = RankTimes([1.0, 1.0], {"attention": [0.2, 0.6], "reduce_scatter": [0.1, 0.1]}, ["reduce_scatter"])
    b = RankTimes([1.0, 1.0], {"attention": [0.4, 0.1], "reduce_scatter": [0.3, 0.2]}, ["reduce_scatter"])
    stages = {s["stage"]: s for s in summarize(BenchSpec(rounds=2), [a, b])["stages"]}
    assert stages["attention"]["median_s"] == statistics.median([0.4, 0.6]) and not stages["attention"]["collective"]
    assert stages["reduce_scatter"]["collective"] and stages["reduce_scatter"]["per_rank_median_s"] == [0.1, 0.25]


def test_rounds_restore_the_in_out_tensors_and_nothing_accumulates():
    case = Case("swa", TINY, 1, 32, 4)
    layer = get_layer("swa")
    ctx = RankContext(case, 0, torch.device("cpu"))
    inputs = layer.rank_inputs(case, 0)
    validated = TorchTP()(ctx, {n: t.clone() for n, t in inputs.items()})
    tensors = {n: t.clone() for n, t in inputs.items()}
    pristine = {"kv_cache": inputs["kv_cache"].clone()}
    times = run_rounds(TorchTP(), ctx, tensors, pristine, BenchSpec(rounds=3, warmup=1, stages=True))
    assert torch.equal(tensors["kv_cache"], validated["kv_cache"])  # as after one step, not four
    assert len(times.rounds_s) == 3 and list(times.stages_s) == [s.name for s in layer.stages(TINY)]
    assert times.collective_stages == ["group_all_to_all", "reduce_scatter"]


def test_an_accumulating_step_starts_every_round_from_the_same_state():
    # The layer's own writes are idempotent; a step that adds to its state shows the restore.
    def increments(ctx, tensors):
        tensors["state"] += 1
        return {"state": tensors["state"]}

    ctx = RankContext(Case("swa", TINY, 1, 32, 4), 0, torch.device("cpu"))
    tensors = {"state": torch.ones(3) + 1}  # after the validated step
    run_rounds(increments, ctx, tensors, {"state": torch.ones(3)}, BenchSpec(rounds=3, warmup=2))
    assert torch.equal(tensors["state"], torch.full((3,), 2.0))


SLEEP_S = 0.05


class Sleepy(TorchTP):
    """The default implementation, slower per call by a sleep: a lower bound on every round."""

    def __call__(self, ctx, tensors):
        time.sleep(SLEEP_S)
        return super().__call__(ctx, tensors)


class SlowRank1InRound3(TorchTP):
    """Rank 1 takes 300 ms longer in its fourth call: the validated step and two rounds before."""

    calls = 0

    def __call__(self, ctx, tensors):
        self.calls += 1
        if ctx.rank == 1 and self.calls == 4:
            time.sleep(0.3)
        return super().__call__(ctx, tensors)


def test_a_slower_implementation_is_slower_in_every_round(tp_run):
    # What a sleep guarantees, whatever the machine's load: every timed round of every rank holds
    # it (a benchmark that timed anything but the implementation's calls would not), and the
    # figures are those rounds'. Never a comparison with another run's seconds.
    slow = tp_run(layer="swa", tp=2, model="tiny", impl=Sleepy, overrides=["bench.rounds=5", "bench.warmup=1"])
    assert slow.passed, slow
    bench = slow.result["bench"]
    assert len(bench["raw_s"]) == 5 and all(len(r) == 2 and min(r) >= SLEEP_S for r in bench["raw_s"])
    assert bench["min_s"] >= SLEEP_S and bench["median_s"] == statistics.median(max(r) for r in bench["raw_s"])
    assert "bench: 5 rounds after 1 warm-up" in slow.report


def test_a_rank_slower_in_one_round_is_that_rounds_figure(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", impl=SlowRank1InRound3, overrides=["bench.rounds=4"])
    assert run.passed, run
    raw = run.result["bench"]["raw_s"]
    assert len(raw) == 4 and all(len(r) == 2 for r in raw)
    # Round index 2 is the fourth call: its delay is a lower bound of rank 1's figure there (a
    # loaded machine may make another round slower still, so no round is asserted the slowest).
    assert raw[2][1] >= 0.3
    assert run.result["bench"]["max_s"] == max(max(r) for r in raw)
    assert run.result["bench"]["per_rank"][1]["max_s"] == max(r[1] for r in raw) >= 0.3


def test_stage_times_name_the_collectives(tp_run):
    run = tp_run(layer="hca", tp=2, model="tiny", overrides=["bench.rounds=2", "bench.stages=true"])
    assert run.passed, run
    stages = {s["stage"]: s for s in run.result["bench"]["stages"]}
    assert list(stages) == [s.name for s in get_layer("hca").stages(TINY)]
    assert {n for n, s in stages.items() if s["collective"]} == {"group_all_to_all", "reduce_scatter"}
    assert "group_all_to_all (collective)" in run.report


def test_a_performance_run_is_unchecked_and_exits_0(tp_run):
    run = tp_run(layer="csa", tp=2, model="tiny", overrides=["golden=false", "bench.rounds=2"])
    assert run.exit_code == 0, run
    assert run.result["verdict"] == "UNCHECKED" and run.result["verdicts"] == []
    assert "golden" not in run.result["rank_seconds"][0] and "compare" not in run.result["rank_seconds"][0]
    assert "VERDICT: UNCHECKED" in run.report


@pytest.mark.parametrize("bad, message", [
    (["golden=false", "save_data=/tmp/x"], "cannot go with save_data"),
    (["golden=false", "golden_data=/tmp/x"], "cannot go with golden_data"),
    (["golden=false", "bisect=true"], "bisect=true has nothing to compare against"),
    (["profile=true"], "set bench.rounds=N"),
    (["bench.warmup=2"], "set bench.rounds=N"),
    (["bench.rounds=-1"], "must be >= 0"),
    (["fault.kind=raise", "fault.phase=bench"], "never runs without bench.rounds=N"),
    (["golden=false", "fault.kind=raise", "fault.phase=compare"], "never runs without golden=true"),
])
def test_bad_benchmark_config_is_refused(tp_run, bad, message):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=bad)
    assert run.exit_code == 2 and message in run.report, run


def test_profile_writes_one_trace_per_rank(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=["bench.rounds=1", "profile=true"])
    assert run.passed, run
    assert run.result["bench"]["profiles"] == ["profile/rank0.json", "profile/rank1.json"]
    for rank in range(2):
        with open(f"{run.output_dir}/profile/rank{rank}.json") as f:
            assert json.load(f)["traceEvents"], rank


def test_a_sweep_reports_each_jobs_median(tmp_path):
    p, summary, junit = multirun(tmp_path, "layer=swa", "model=tiny", "tp=1,2", "bench.rounds=2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(j["bench_median_s"] > 0 for j in summary["jobs"])
    assert "bench_ms" in p.stdout
    props = junit.findall(".//testcase/properties/property[@name='bench_median_s']")
    assert [float(e.get("value")) for e in props] == [j["bench_median_s"] for j in summary["jobs"]]


def test_the_bench_line_gives_rounds_over_a_second_in_seconds():
    lines = bench_lines({"rounds": 2, "warmup": 0, "min_s": 0.0247, "median_s": 3.79, "mean_s": 3.86, "max_s": 4.4})
    assert lines == ["bench: 2 rounds after 0 warm-up, slowest rank per round: "
                     "min 24.7 ms | median 3.79 s | mean 3.86 s | max 4.4 s"]
