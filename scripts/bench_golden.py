"""The flash and memory benchmarks: a flash run end to end against the golden of the same shards
computed alone in one process (`golden-alone`) and against the public reference's own fixture +
golden (`scripts/reference_run.py`); each rank's peak RSS against the bytes its tensors account for."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

from bench_runs import CORES, ROOT, best, case_keys, run_launcher


def golden_alone(layer: str, model: str, tp: int, local_t: int, threads: int) -> dict:
    """The golden of every shard in this one process, shard by shard (one shard held at a time)."""
    t_import = time.perf_counter()
    import torch

    from launcher.run import forkserver
    from layers.contract.case import Case
    from layers.contract.config import PRESETS
    from layers.registry import get_layer

    forkserver.set_cpu_env()
    torch.set_num_threads(threads)
    lay = get_layer(layer)
    case = Case(layer=layer, model=PRESETS[model], tp=tp, local_t=local_t, seed=20260819)
    out = {"import_s": time.perf_counter() - t_import, "threads": threads, "fixture_s": [], "golden_s": [],
           "fixture_transient_bytes": [], "golden_transient_bytes": []}
    t = time.perf_counter()
    wo_a, wo_b = lay.full_o_weights(case)
    out["full_o_s"] = time.perf_counter() - t
    for r in range(tp):
        before = _reset_peak_rss()
        t = time.perf_counter()
        tensors = lay.rank_inputs(case, r)
        out["fixture_s"].append(time.perf_counter() - t)
        out["fixture_transient_bytes"].append(_status_bytes("VmHWM") - before)  # the slice included
        tensors["wo_a"], tensors["wo_b"] = wo_a, wo_b
        before = _reset_peak_rss()
        t = time.perf_counter()
        lay.golden(case, tensors)
        out["golden_s"].append(time.perf_counter() - t)
        out["golden_transient_bytes"].append(_status_bytes("VmHWM") - before)
        del tensors
    return out


def _status_bytes(key: str) -> int:
    m = re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read())
    return int(m.group(1)) * 1024


def _reset_peak_rss() -> int:
    """Hand freed heap back to the OS, then reset this process's VmHWM to its current RSS
    (Linux clear_refs 5); return that RSS. Without the trim a stage would reuse heap an
    earlier one freed and its transient would read too low (and vary from run to run)."""
    from launcher.run.worker import release_freed_memory

    release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def run_golden_alone(layer: str, model: str, tp: int, local_t: int, threads: int) -> tuple[float, dict]:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "golden-alone", f"--layer={layer}", f"--model={model}", f"--tp={tp}",
           f"--local-t={local_t}", f"--threads={threads}"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return time.perf_counter() - t0, json.loads(out.strip().splitlines()[-1])


def run_reference(reference: str, tp: int, local_t: int, threads: int | None) -> tuple[float, dict]:
    """The public reference's own fixture + golden of the same shards, in a fresh process
    (`scripts/reference_run.py`, importing the user's pypto-lib checkout): (wall s, its split)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "reference_run.py"), f"--reference={reference}", f"--tp={tp}",
           f"--local-t={local_t}"] + ([f"--threads={threads}"] if threads is not None else [])
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return time.perf_counter() - t0, json.loads(out.strip().splitlines()[-1])


def bench_reference(tmp: str, reference: str, pairs: int, threads: int | None, layer: str = "csa", tp: int = 2,
                    local_t: int = 64) -> dict:
    """`python -m launcher layer=csa model=flash ...` end to end against the reference's own
    fixture + golden of the same two shards, measured alternately `pairs` times: the median of
    the pairs' ratios (the reference's time swings with the load more than ours)."""
    if layer != "csa":
        raise SystemExit("--reference compares the CSA layer (the reference's decode_csa)")
    out: dict = {"case": f"{layer} flash tp={tp} local_t={local_t}", "pairs": [], "load": [os.getloadavg()[0]]}
    for i in range(pairs):
        ours = run_launcher(os.path.join(tmp, f"vs-reference{i}"), case_keys(layer, "flash", tp, local_t))
        theirs, split = run_reference(reference, tp, local_t, threads)
        out["pairs"].append({"ours_s": ours.wall_s, "reference_s": theirs, "ratio": ours.wall_s / theirs,
                             "reference": split, "ours_stages": ours.stage_walls()})
        print(f"  pair {i + 1}/{pairs}: ours {ours.wall_s:.2f} s, reference {theirs:.2f} s, "
              f"ratio {ours.wall_s / theirs:.2f} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    out["load"].append(os.getloadavg()[0])
    med = lambda key: statistics.median(p[key] for p in out["pairs"])  # noqa: E731
    out.update({"median_ratio": med("ratio"), "target": 0.7, "median_ours_s": med("ours_s"),
                "median_reference_s": med("reference_s"),
                "reference_threads": out["pairs"][0]["reference"]["threads"] if out["pairs"] else None})
    return out


def bench_flash(tmp: str, repeats: int, layer: str = "csa", tp: int = 2, local_t: int = 64,
                reference: str | None = None, pairs: int = 5, reference_threads: int | None = None) -> dict:
    """End to end at flash dims vs the golden of the same shards computed alone in one process
    and, given a pypto-lib checkout, vs the reference's own fixture + golden (`bench_reference`)."""
    vs_reference = bench_reference(tmp, reference, pairs, reference_threads, layer, tp, local_t) if reference else None
    e2e, alone = [], []
    for i in range(repeats):
        e2e.append(run_launcher(os.path.join(tmp, f"flash{i}"), case_keys(layer, "flash", tp, local_t)))
        alone.append(run_golden_alone(layer, "flash", tp, local_t, CORES))
    # Measured apart: the golden cache, filled by a first run, read by the next ones.
    cache = os.path.join(tmp, "golden-cache")
    keys = case_keys(layer, "flash", tp, local_t)
    run_launcher(os.path.join(tmp, "flash-cache-fill"), keys, golden_cache=cache)
    cached = best([run_launcher(os.path.join(tmp, f"flash-cached{i}"), keys, golden_cache=cache) for i in range(repeats)])
    b = best(e2e)
    a_wall, a = min(alone, key=lambda x: x[0])
    golden_compute = sum(a["golden_s"])
    walls = {**b.stage_walls(), **b.phases()}
    del walls["stages"]
    return {
        "case": f"{layer} flash tp={tp} local_t={local_t}",
        "e2e_s": b.wall_s, "e2e_all_s": [r.wall_s for r in e2e],
        "golden_alone_process_s": a_wall, "golden_alone": a, "golden_alone_compute_s": golden_compute,
        "ratio_vs_process": b.wall_s / a_wall, "ratio_vs_compute": b.wall_s / golden_compute, "target": 1.5,
        "shares": {k: v / b.wall_s for k, v in walls.items()}, "walls": walls,
        "rank_seconds": b.result.get("rank_seconds"),
        "cached_e2e_s": cached.wall_s, "cached_golden_s": cached.stage_walls()["golden"],
        **({"reference": vs_reference} if vs_reference else {}),
    }


def _spec_bytes(specs: dict, names) -> int:
    return sum(math.prod(specs[n].shape) * specs[n].dtype.itemsize for n in names)


def working_set(layer: str, model: str, tp: int, local_t: int) -> dict:
    """Bytes of the tensors one rank holds at once, from the layer's tensor inventory."""
    from layers.contract.checks import PoolCheck
    from layers.contract.tensors import Kind
    from layers.contract.case import Case
    from layers.contract.config import PRESETS
    from layers.registry import get_layer
    from launcher.run import judging
    from launcher.verify.base import initial_key

    lay = get_layer(layer)
    case = Case(layer=layer, model=PRESETS[model], tp=tp, local_t=local_t, seed=20260819)
    specs = lay.tensor_specs(case)
    inputs = [n for n, s in specs.items() if s.kind is not Kind.OUTPUT]
    compared = lay.compared_names(case)
    o_shard = _spec_bytes(specs, ("wo_a", "wo_b"))
    mappings = sorted({c.mapping for c in lay.checks(case) if isinstance(c, PoolCheck)})
    inout = _spec_bytes(specs, [n for n, s in specs.items() if s.kind is Kind.INOUT])
    compared_inout = [n for n in compared if specs[n].kind is Kind.INOUT]
    context = _spec_bytes(specs, mappings) + _spec_bytes(specs, compared_inout)
    fixture = _spec_bytes(specs, inputs)
    outputs = _spec_bytes(specs, compared)
    # What each rank judges (the worker's plan), every rank's shard of it stacked.
    judged = [0] * tp
    for a in judging.plan(lay.checks(case), [*mappings, *map(initial_key, compared_inout)], specs, 1, tp):
        own = [n.removeprefix(initial_key("")) for n in a.context]
        judged[a.judge] += tp * (2 * _spec_bytes(specs, [a.output]) + _spec_bytes(specs, own))
    return {
        "fixture": fixture,
        # Beside the slice: the full O weights (drawn with it) and worker.golden_outputs' clones
        # of the in-out tensors; the pure inputs are shared with the slice.
        "golden_inputs": inout + tp * o_shard,
        "outputs": 2 * outputs,  # the golden's and the implementation's
        "context": context,  # pre-step pools and slot mappings kept for the comparators
        "judged": judged,  # per rank: the stacked actual, golden and context of the checks it judges
    }


def bench_memory(tmp: str, layers: list[str], tp: int = 4) -> dict:
    """Per-rank peak RSS at flash dims vs the bytes the rank's tensors account for."""
    base = run_launcher(os.path.join(tmp, "mem-tiny"), case_keys("swa", "tiny", tp), sample_rss=True)
    baseline = min(base.peak_rss.values())  # interpreter + torch + launcher, tiny tensors
    out = {"tp": tp, "baseline_bytes": baseline, "layers": {}}
    for layer in layers:
        run = run_launcher(os.path.join(tmp, f"mem-{layer}"), case_keys(layer, "flash", tp), sample_rss=True)
        local_t = run.result["case"]["local_t"]
        ws = working_set(layer, "flash", tp, local_t)
        _, alone = run_golden_alone(layer, "flash", tp, local_t, max(1, CORES // tp))
        # Measured in a process that builds the shards one after another: the maximum over
        # shards (a later shard reuses heap the earlier one freed, and grows the RSS less).
        ws["fixture_transient"] = max(alone["fixture_transient_bytes"])
        ws["golden_transient"] = max(alone["golden_transient_bytes"])
        out["layers"][layer] = {"local_t": local_t, "peak_rss": run.peak_rss, "working_set": ws,
                                "golden_alone": {k: v for k, v in alone.items() if k.endswith("_bytes")}}
    return out

