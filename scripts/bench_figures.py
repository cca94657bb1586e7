"""The benchmarks that time whole launcher runs against a baseline or each other: launch vs
torchrun, a sweep vs one run, the threads rule, the scaling table; and `loops`, the Python call
counts of a layer's stages as its dims double."""

from __future__ import annotations

import os
from pathlib import Path

from bench_runs import CORES, Run, best, case_keys, run_launcher, run_sweep, timed, torchrun_cmd

# What `torchrun` starts in the launch baseline: import torch, join a gloo group, one barrier.
TORCHRUN_SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def bench_launch(tmp: str, repeats: int) -> dict:
    """`python -m launcher layer=swa tp=8 model=tiny` vs `torchrun --nproc_per_node 8` of a bare gloo script."""
    script = os.path.join(tmp, "bare_gloo.py")
    Path(script).write_text(TORCHRUN_SCRIPT)
    ours, theirs = [], []
    for i in range(repeats):  # alternated, so both sides see the same background load
        ours.append(run_launcher(os.path.join(tmp, f"launch{i}"), case_keys("swa", "tiny", 8)))
        theirs.append(timed(torchrun_cmd(script, 8), cwd=tmp))
    b = best(ours)
    return {
        "launcher_s": b.wall_s, "launcher_all_s": [r.wall_s for r in ours],
        "torchrun_s": min(theirs), "torchrun_all_s": theirs,
        "ratio": b.wall_s / min(theirs), "target": 0.25,
        "phases": b.phases(), "stages": b.stage_walls(),
    }


def bench_sweep(tmp: str, repeats: int) -> dict:
    """`python -m launcher -m +sweep=smoke` (six tiny jobs) vs one tiny SWA tp=8 run, the same
    sweep on fresh rank processes for every job (`warm_ranks=false`), and both commands again
    with a golden cache a first run of each filled (a sweep rerun unchanged, as in a CI loop),
    alternated."""
    cache = os.path.join(tmp, "sweep-golden-cache")
    run_launcher(os.path.join(tmp, "one-fill"), case_keys("swa", "tiny", 8), golden_cache=cache)
    run_sweep(os.path.join(tmp, "sweep-fill"), ["+sweep=smoke"], golden_cache=cache)
    one, warm, cold, one_cached, warm_cached = [], [], [], [], []
    for i in range(repeats):
        one.append(run_launcher(os.path.join(tmp, f"one{i}"), case_keys("swa", "tiny", 8)))
        warm.append(run_sweep(os.path.join(tmp, f"warm{i}"), ["+sweep=smoke"]))
        cold.append(run_sweep(os.path.join(tmp, f"cold{i}"), ["+sweep=smoke", "warm_ranks=false"]))
        one_cached.append(run_launcher(os.path.join(tmp, f"one-cached{i}"), case_keys("swa", "tiny", 8),
                                       golden_cache=cache))
        warm_cached.append(run_sweep(os.path.join(tmp, f"warm-cached{i}"), ["+sweep=smoke"], golden_cache=cache))
    best_one, best_warm, best_cold, best_one_cached, best_warm_cached = (
        min(runs, key=lambda r: r.wall_s) for runs in (one, warm, cold, one_cached, warm_cached))
    return {"one_s": best_one.wall_s, "warm_s": best_warm.wall_s, "cold_s": best_cold.wall_s,
            "one_all_s": [r.wall_s for r in one], "warm_all_s": [r.wall_s for r in warm],
            "cold_all_s": [r.wall_s for r in cold], "ratio": best_warm.wall_s / best_one.wall_s, "target": 1.5,
            "cold_ratio": best_cold.wall_s / best_one.wall_s, "phases": best_warm.phases(),
            "one_phases": best_one.phases(),
            "one_busy_core_s": best_one.busy_core_s, "warm_busy_core_s": best_warm.busy_core_s,
            "one_stage_cpu_s": best_one.stage_cpu_s, "warm_stage_cpu_s": best_warm.stage_cpu_s,
            "one_cached_stage_cpu_s": best_one_cached.stage_cpu_s,
            "warm_cached_stage_cpu_s": best_warm_cached.stage_cpu_s,
            "one_cached_s": best_one_cached.wall_s, "warm_cached_s": best_warm_cached.wall_s,
            "cached_ratio": best_warm_cached.wall_s / best_one_cached.wall_s}



def bench_threads(tmp: str, repeats: int, layer: str = "csa", tp: int = 2, local_t: int = 64) -> dict:
    """The rule (cores // ranks per node threads each) against every rank taking every core."""
    rule = max(1, CORES // tp)
    runs: dict[int, list[Run]] = {rule: [], CORES: []}
    for i in range(repeats):
        for th in runs:
            keys = case_keys(layer, "flash", tp, local_t, f"threads_per_rank={th}")
            runs[th].append(run_launcher(os.path.join(tmp, f"threads{th}-{i}"), keys))
    return {"case": f"{layer} flash tp={tp} local_t={local_t}", "cores": CORES,
            "walls": {th: best(rs).wall_s for th, rs in runs.items()},
            "stages": {th: best(rs).stage_walls() for th, rs in runs.items()}}


# What `loops` doubles, at tiny dims and tp=1, to find Python loops whose trip count grows
# with it: the call count of a vectorised step does not change.
LOOP_AXES = {
    "tokens": lambda m: ({}, 2),
    "heads": lambda m: ({"num_attention_heads": 2 * m.num_attention_heads, "index_n_heads": 2 * m.index_n_heads}, 1),
    "cache rows": lambda m: ({"kv_ori_block_num": 2 * m.kv_ori_block_num, "kv_cmp_block_num": 2 * m.kv_cmp_block_num,
                              "idx_cache_block_num": 2 * m.idx_cache_block_num}, 1),
}


def _calls(fn) -> int:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof).total_calls


def bench_loops(layers: list[str], local_t: int = 32) -> dict:
    """Python function calls of fixture, golden and TP forward (tp=1) as each axis doubles."""
    import torch

    from layers.contract.context import RankContext
    from layers.contract.case import Case
    from layers.contract.config import TINY
    from layers.registry import get_layer

    torch.set_num_threads(1)
    out = {}
    for layer in layers:
        lay = get_layer(layer)

        def counts(model, lt):
            case = Case(layer=layer, model=model, tp=1, local_t=lt, seed=20260819)
            lay.validate(case)
            stages = {"fixture": _calls(lambda: lay.rank_inputs(case, 0))}
            inputs = lay.rank_inputs(case, 0)
            stages["golden"] = _calls(lambda: lay.golden(case, {n: t.clone() for n, t in inputs.items()}))
            ctx = RankContext(case=case, rank=0, device=torch.device("cpu"), group=None)
            stages["forward"] = _calls(lambda: lay.forward(ctx, {n: t.clone() for n, t in inputs.items()}))
            return stages

        base = counts(TINY, local_t)
        out[layer] = {"base": base}
        for axis, change in LOOP_AXES.items():
            fields, t_factor = change(TINY)
            out[layer][axis] = counts(TINY.replace(**fields), local_t * t_factor)
    return out


SCALING = {  # model -> (local_t for the tp sweep, tp of the local_t sweep, local_t values)
    "tiny": (16, 2, (8, 16, 32, 64)),
    "flash": (64, 2, (16, 32, 64, 128, 256)),
}
TPS = (1, 2, 4, 8)


def bench_scaling(tmp: str, repeats: int, layers: list[str], models: list[str]) -> dict:
    """Wall time vs tp at fixed tokens per rank, and vs local_t at fixed tp."""
    out: dict = {"tp": {}, "local_t": {}, "setup": {m: SCALING[m] for m in models}}
    for model in models:
        lt_fixed, tp_fixed, lts = SCALING[model]
        for layer in layers:
            key = f"{model} {layer}"
            walls_tp, walls_lt = {}, {}
            for tp in TPS:
                walls_tp[tp] = min(run_launcher(os.path.join(tmp, f"s-{model}-{layer}-tp{tp}-{i}"),
                                                case_keys(layer, model, tp, lt_fixed)).wall_s for i in range(repeats))
            for lt in lts:
                if lt == lt_fixed and tp_fixed in walls_tp:
                    walls_lt[lt] = walls_tp[tp_fixed]
                    continue
                walls_lt[lt] = min(run_launcher(os.path.join(tmp, f"s-{model}-{layer}-lt{lt}-{i}"),
                                                case_keys(layer, model, tp_fixed, lt)).wall_s for i in range(repeats))
            out["tp"][key], out["local_t"][key] = walls_tp, walls_lt
    return out

