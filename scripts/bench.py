"""Benchmarks of the orchestrator's own overhead, measured side by side in one run.

    python scripts/bench.py all                 # everything below, tables + bench.json + scaling.png
    python scripts/bench.py launch              # tiny SWA tp=8 end to end vs torchrun of a bare gloo script
    python scripts/bench.py sweep               # +sweep=smoke (6 tiny jobs) vs one tiny SWA tp=8 run
    python scripts/bench.py flash               # CSA flash tp=2 local_t=64 end to end vs its golden alone
    python scripts/bench.py memory              # per-rank peak RSS at flash tp=4 vs fixture + working set
    python scripts/bench.py threads             # the threads-per-rank rule vs oversubscribed ranks
    python scripts/bench.py loops               # Python calls as tokens / heads / cache rows double
    python scripts/bench.py scaling             # wall time vs tp and vs local_t, tiny and flash, + PNG
    python scripts/bench.py plot                # scaling.png again from the figures in bench.json
    python scripts/bench.py front               # --help, --cfg job, a refusal, sweep list, compare (front_bench.py)

Every launcher run is `python -m launcher ... golden_cache=null` in a fresh interpreter (the
cache would turn the golden and fixture stages into file reads; `sweep` and `flash` also
measure a filled cache apart),
timed from process start to exit. The machine is shared and noisy: each figure is the minimum
over `--repeats` runs, and the two sides of a ratio are measured alternately in the same
invocation, so they see the same load.
Stage walls come from the ranks' progress events (first start to last done over all ranks),
and so do the phases of a run or a sweep (a sweep is cut at each job's first and last event);
per-rank peak RSS is the VmHWM of each rank process, sampled from /proc while it runs (ranks
are told apart by the per-rank stdout log their fd 1 points to); the CPU a run or a sweep took
is the machine's busy time while it ran (/proc/stat: every process on the machine, so read it
on a quiet one), against the core-seconds its wall time offered, and the ranks' own CPU in
their stages is result.json's `rank_cpu_seconds`, summed. Results go to stdout as
Markdown tables and to `<out>/bench.json`; `scaling` also writes `<out>/scaling.png`, drawn
with matplotlib (the `plots` extra). `golden-alone` is the one-process
reference the flash ratio divides by (run as a subprocess of `flash`).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # front_bench.py, beside this file, however this file was loaded

import front_bench  # noqa: E402

CORES = os.cpu_count() or 1
MB = 2**20

# What `torchrun` starts in the launch baseline: import torch, join a gloo group, one barrier.
TORCHRUN_SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


# -- running things ------------------------------------------------------------------------------
@dataclass
class Run:
    """One launcher process: its wall time, result.json, stage events and ranks' peak RSS."""

    wall_s: float
    started: float  # time.time() just before the process was started
    result: dict
    events: list[dict]
    peak_rss: dict[int, int] = field(default_factory=dict)  # local rank -> VmHWM bytes
    busy_core_s: float | None = None  # the machine's busy CPU time while it ran

    @property
    def stage_cpu_s(self) -> float | None:
        """Every rank's CPU in its stages, summed."""
        return _stage_cpu_s(self.result)

    def stage_walls(self) -> dict[str, float]:
        """Per stage: first start to last done over all ranks (ranks run a stage concurrently)."""
        spans: dict[str, list[float]] = {}
        for ev in self.events:
            lo_hi = spans.setdefault(ev["stage"], [math.inf, -math.inf])
            if ev["event"] == "start":
                lo_hi[0] = min(lo_hi[0], ev["t"])
            elif ev["event"] == "done":
                lo_hi[1] = max(lo_hi[1], ev["t"])
        return {name: hi - lo for name, (lo, hi) in spans.items()}

    def phases(self) -> dict[str, float]:
        """The run cut at the ranks' first and last events: start-up, ranks' stages, exit."""
        first = min(ev["t"] for ev in self.events)
        last = max(ev["t"] for ev in self.events)
        return {"start-up": first - self.started, "stages": last - first,
                "exit": self.started + self.wall_s - last}


@dataclass
class SweepRun:
    """One `python -m launcher -m ...` process: its wall time and each job's stage events."""

    wall_s: float
    started: float  # time.time() just before the process was started
    jobs: list[list[dict]]  # the stage events of every job, in job order
    busy_core_s: float | None = None  # the machine's busy CPU time while it ran
    stage_cpu_s: float | None = None  # every job's ranks' CPU in their stages, summed

    def phases(self) -> dict[str, float]:
        """The sweep cut at each job's first and last rank events: start-up (imports, every
        job's composition, the first job's ranks), the jobs' stages, the launcher's time
        between two jobs (a job's report, the next one's Hydra set-up, preflight and hand-off
        to its ranks) and the exit."""
        spans = [(min(e["t"] for e in events), max(e["t"] for e in events)) for events in self.jobs]
        return {"start-up": spans[0][0] - self.started, "stages": sum(hi - lo for lo, hi in spans),
                "between jobs": sum(nxt[0] - cur[1] for cur, nxt in zip(spans, spans[1:])),
                "exit": self.started + self.wall_s - spans[-1][1]}


def _busy_core_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (None without /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _busy_since(before: float | None) -> float | None:
    after = _busy_core_s()
    return None if before is None or after is None else after - before


def _stage_cpu_s(result: dict) -> float | None:
    """The CPU every rank of a run spent in its stages (fixture .. compare), summed."""
    per_rank = result.get("rank_cpu_seconds")
    return None if per_rank is None else sum(sum(stages.values()) for stages in per_rank)


def _events(out_dir: str) -> list[dict]:
    return [json.loads(line) for p in glob.glob(os.path.join(out_dir, "progress", "rank*.jsonl"))
            for line in open(p) if line.strip()]


def _proc_children(pid: int) -> list[int]:
    kids = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids += [int(p) for p in open(path).read().split()]
        except OSError:
            pass
    return kids


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _proc_children(todo.pop())
        out += kids
        todo += kids
    return out


_RANK_LOG = re.compile(r"/attempt_\d+/(\d+)/stdout\.log$")


def _sample_rss(proc: subprocess.Popen, peaks: dict[int, int], period_s: float) -> None:
    """Until `proc` exits: the VmHWM of every rank process under it, by local rank."""
    ranks: dict[int, int] = {}  # pid -> local rank
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            if pid not in ranks:
                try:
                    m = _RANK_LOG.search(os.readlink(f"/proc/{pid}/fd/1"))
                except OSError:
                    continue
                if m:
                    ranks[pid] = int(m.group(1))
        for pid, rank in ranks.items():
            try:
                status = open(f"/proc/{pid}/status").read()
            except OSError:
                continue
            m = re.search(r"VmHWM:\s+(\d+) kB", status)
            if m:
                peaks[rank] = max(peaks.get(rank, 0), int(m.group(1)) * 1024)
        time.sleep(period_s)


def run_launcher(out_dir: str, overrides: list[str], sample_rss: bool = False, golden_cache: str = "null") -> Run:
    """`python -m launcher <overrides>` end to end, the golden cache off unless given; it must PASS."""
    cmd = [sys.executable, "-m", "launcher", *overrides, f"golden_cache={golden_cache}", f"hydra.run.dir={out_dir}"]
    log = out_dir + ".log"
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    peaks: dict[int, int] = {}
    with open(log, "w") as f:
        started, t0, busy = time.time(), time.perf_counter(), _busy_core_s()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        sampler = None
        if sample_rss:
            sampler = threading.Thread(target=_sample_rss, args=(proc, peaks, 0.01), daemon=True)
            sampler.start()
        code = proc.wait()
        wall, busy = time.perf_counter() - t0, _busy_since(busy)
        if sampler is not None:
            sampler.join()
    if code != 0:
        tail = "".join(open(log).readlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; log {log}:\n{tail}")
    with open(os.path.join(out_dir, "result.json")) as f:
        result = json.load(f)
    return Run(wall_s=wall, started=started, result=result, events=_events(out_dir), peak_rss=peaks, busy_core_s=busy)


def run_sweep(sweep_dir: str, overrides: list[str], golden_cache: str = "null") -> SweepRun:
    """`python -m launcher -m <overrides>` end to end, the golden cache off unless given; every job must PASS."""
    cmd = [sys.executable, "-m", "launcher", "-m", *overrides, f"golden_cache={golden_cache}",
           f"hydra.sweep.dir={sweep_dir}"]
    started, t0, busy = time.time(), time.perf_counter(), _busy_core_s()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, busy = time.perf_counter() - t0, _busy_since(busy)
    jobs = sorted((d for d in os.listdir(sweep_dir) if d.isdigit()), key=int)
    cpu = []
    for d in jobs:
        with open(os.path.join(sweep_dir, d, "result.json")) as f:
            cpu.append(_stage_cpu_s(json.load(f)))
    return SweepRun(wall_s=wall, started=started, jobs=[_events(os.path.join(sweep_dir, d)) for d in jobs],
                    busy_core_s=busy, stage_cpu_s=None if None in cpu else sum(cpu))


def timed(cmd: list[str], **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    return time.perf_counter() - t0


def torchrun_cmd(script: str, nproc: int) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    # --standalone: rendezvous on a free local port, so concurrent benchmarks never collide.
    # --log-dir: beside the script, removed with it (torchrun's default is a new folder in /tmp).
    log_dir = os.path.join(os.path.dirname(script), "torchrun-logs")
    return [*base, "--standalone", f"--nproc_per_node={nproc}", f"--log-dir={log_dir}", script]


def best(runs: list[Run]) -> Run:
    return min(runs, key=lambda r: r.wall_s)


def case_keys(layer: str, model: str, tp: int, local_t: int | None = None, *extra: str) -> list[str]:
    keys = [f"layer={layer}", f"model={model}", f"tp={tp}", *extra]
    return keys + ([f"local_t={local_t}"] if local_t is not None else [])


# -- figures ---------------------------------------------------------------------------------------
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
    cmd = [sys.executable, __file__, "golden-alone", f"--layer={layer}", f"--model={model}", f"--tp={tp}",
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


# -- the scaling plot ------------------------------------------------------------------------------
def scaling_figure(scaling: dict):
    """Wall time (log y) against tp and against local_t (log2 x): one line per model and layer,
    the two panels on one y scale."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from launcher.report.plots import figure

    fig = figure(12.0, 4.8)
    axes = fig.subplots(1, 2, sharey=True)
    panels = (("tp", "wall s vs tp (local_t fixed: 16 tiny, 64 flash)", "tp"),
              ("local_t", "wall s vs local_t (tp=2)", "local_t (tokens per rank)"))
    for ax, (kind, title, xlabel) in zip(axes, panels):
        xs = sorted({int(x) for s in scaling[kind].values() for x in s})
        for name, pts in scaling[kind].items():
            points = sorted((int(x), v) for x, v in pts.items())
            ax.plot([x for x, _ in points], [v for _, v in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", color="#dddddd")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel("wall s, end to end (min of runs)")
    axes[0].legend(frameon=False)
    return fig


def write_scaling_png(path: str, scaling: dict) -> None:
    from launcher.report.plots import available, png

    if not available():
        print("scaling.png not written: matplotlib is not installed (pip install '.[plots]')", file=sys.stderr)
        return
    Path(path).write_bytes(png(scaling_figure(scaling)))


# -- Markdown ----------------------------------------------------------------------------------------
def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def report_launch(r: dict) -> str:
    ph = r["phases"]
    rows = [
        ["`python -m launcher layer=swa tp=8 model=tiny`", f"{r['launcher_s']:.2f}"],
        ["`torchrun --nproc_per_node 8` (import torch, gloo init, one barrier)", f"{r['torchrun_s']:.2f}"],
        [f"**ratio** (target <= {r['target']})", f"**{r['ratio']:.2f}**"],
        ["launcher: start-up (imports, compose, forkserver, rank processes, process group)", f"{ph['start-up']:.2f}"],
        ["launcher: ranks' stages (fixture .. compare)", f"{ph['stages']:.2f}"],
        ["launcher: exit (report, ranks' exit)", f"{ph['exit']:.2f}"],
    ]
    return _table(["launch", "wall s (min)"], rows)


def report_sweep(r: dict) -> str:
    rows = [
        ["`python -m launcher layer=swa tp=8 model=tiny`", f"{r['one_s']:.2f}"],
        ["`python -m launcher -m +sweep=smoke` (6 jobs, warm ranks)", f"{r['warm_s']:.2f}"],
        ["the same sweep, `warm_ranks=false` (fresh ranks per job)", f"{r['cold_s']:.2f}"],
        [f"**ratio** sweep / one run (target <= {r['target']})", f"**{r['ratio']:.2f}**"],
        ["ratio with fresh ranks per job", f"{r['cold_ratio']:.2f}"],
    ]
    if "cached_ratio" in r:  # a bench.json from before has no warm-cache pair
        rows += [
            ["with a filled golden cache: one run / the sweep", f"{r['one_cached_s']:.2f} / {r['warm_cached_s']:.2f}"],
            ["ratio with a filled golden cache", f"{r['cached_ratio']:.2f}"],
        ]
    ph = r.get("phases")  # bench.json of a version before the breakdown has none
    if ph:
        rows += [
            ["sweep: start-up (imports, every job's composition, the first job's ranks)", f"{ph['start-up']:.2f}"],
            ["sweep: the jobs' ranks' stages (fixture .. compare), summed", f"{ph['stages']:.2f}"],
            ["sweep: between two jobs (a report, the next job's set-up and hand-off), summed", f"{ph['between jobs']:.2f}"],
            ["sweep: exit", f"{ph['exit']:.2f}"],
        ]
    one_ph = r.get("one_phases")
    if ph and one_ph:  # what the launcher adds around the ranks' stages (a bench.json from before has none)
        sweep_around, one_around = r["warm_s"] - ph["stages"], r["one_s"] - one_ph["stages"]
        rows += [
            ["the launcher's time around the ranks' stages, s: one run / the sweep (wall less the stages)",
             f"{one_around:.2f} / {sweep_around:.2f}"],
            ["ratio of the two", f"{sweep_around / one_around:.2f}"],
        ]
    one_cpu, sweep_cpu = r.get("one_busy_core_s"), r.get("warm_busy_core_s")
    if one_cpu is not None and sweep_cpu is not None:  # no /proc/stat, or a bench.json from before
        cap = CORES * r["target"] * r["one_s"]
        rows += [
            [f"CPU of the one run (busy core-s of the {CORES * r['one_s']:.2f} its wall offered)", f"{one_cpu:.2f}"],
            [f"CPU of the sweep (busy core-s of the {CORES * r['warm_s']:.2f} its wall offered)", f"{sweep_cpu:.2f}"],
            [f"core-s a sweep at the target could use at most ({CORES} cores x {r['target']} x one run)", f"{cap:.2f}"],
        ]
    for pair, one_s in (("", r["one_s"]), ("cached_", r.get("one_cached_s"))):
        one_stages, sweep_stages = r.get(f"one_{pair}stage_cpu_s"), r.get(f"warm_{pair}stage_cpu_s")
        if one_stages is None or sweep_stages is None:  # a bench.json from before has none
            continue
        cache = ", filled golden cache" if pair else ""
        rows += [
            [f"the ranks' CPU in their stages (fixture .. compare){cache}, core-s: one run / the sweep",
             f"{one_stages:.2f} / {sweep_stages:.2f}"],
            [f"the sweep's extra jobs' stage CPU over {CORES} cores (their wall at best){cache} / the target's room "
             f"({r['target'] - 1:g} x one run), s", f"{(sweep_stages - one_stages) / CORES:.2f} / "
             f"{(r['target'] - 1) * one_s:.2f}"],
        ]
    return _table(["sweep", "wall s (min)"], rows)


def report_flash(r: dict) -> str:
    a = r["golden_alone"]
    rows = [[k, f"{v:.2f}", f"{100 * r['shares'][k]:.0f}%"] for k, v in r["walls"].items()]
    rows += [
        ["**end to end**", f"**{r['e2e_s']:.2f}**", "100%"],
        [f"golden alone, one process ({a['threads']} threads): whole process", f"{r['golden_alone_process_s']:.2f}", ""],
        ["  of which import", f"{a['import_s']:.2f}", ""],
        ["  of which full O weights", f"{a['full_o_s']:.2f}", ""],
        ["  of which fixture, per shard", " / ".join(f"{x:.2f}" for x in a["fixture_s"]), ""],
        ["  of which golden, per shard", " / ".join(f"{x:.2f}" for x in a["golden_s"]), ""],
        ["**ratio** end to end / golden-alone process (target <= 1.5)", f"**{r['ratio_vs_process']:.2f}**", ""],
        ["ratio end to end / golden compute only", f"{r['ratio_vs_compute']:.2f}", ""],
        ["end to end with a warm golden cache (golden stage)", f"{r['cached_e2e_s']:.2f} ({r['cached_golden_s']:.2f})", ""],
    ]
    text = f"{r['case']}\n\n" + _table(["stage", "wall s", "share"], rows)
    return text + ("\n\n" + report_reference(r["reference"]) if "reference" in r else "")


def report_reference(r: dict) -> str:
    """The alternated pairs against the reference, and their median ratio."""
    rows = [[i + 1, f"{p['ours_s']:.2f}", f"{p['reference_s']:.2f}",
             f"{p['reference']['import_s']:.2f} / {p['reference']['fixture_s']:.2f} / {p['reference']['golden_s']:.2f}",
             f"{p['ratio']:.2f}"] for i, p in enumerate(r["pairs"])]
    rows.append(["**median**", f"{r['median_ours_s']:.2f}", f"{r['median_reference_s']:.2f}", "",
                 f"**{r['median_ratio']:.2f}**"])
    head = ["pair", "ours: `python -m launcher` end to end", "reference: fixture + golden, whole process",
            "of which import / fixture / golden", "ratio (target <= 0.7)"]
    return (f"{r['case']} against the reference (its golden on {r['reference_threads']} threads), load average "
            f"{r['load'][0]:.1f} -> {r['load'][1]:.1f}\n\n" + _table(head, rows))


def memory_estimate(ws: dict, rank: int) -> dict:
    """What a rank holds at its three high-water points, above the torch baseline.

    fixture stage: the slice and the builders' temporaries (measured); golden stage: the slice,
    the golden's clones with the full O weights, and the golden's own temporaries (measured);
    gather: both outputs, the comparators' context and every rank's of the checks it judges.
    """
    golden = ws["golden_inputs"] + ws["golden_transient"]  # on top of the fixture slice
    gather = ws["outputs"] + ws["context"] + ws["judged"][rank]
    return {"fixture": ws["fixture_transient"], "golden": golden, "gather": gather,
            "peak": max(ws["fixture_transient"], ws["fixture"] + golden, gather)}


def report_memory(r: dict) -> str:
    rows = []
    for layer, m in r["layers"].items():
        ws = m["working_set"]
        for rank in sorted(m["peak_rss"], key=int):
            est = memory_estimate(ws, int(rank))
            rows.append([layer, rank, f"{m['peak_rss'][rank] / MB:.0f}", f"{r['baseline_bytes'] / MB:.0f}",
                         f"{ws['fixture'] / MB:.0f}", f"{est['fixture'] / MB:.0f}", f"{est['golden'] / MB:.0f}",
                         f"{est['gather'] / MB:.0f}", f"{(r['baseline_bytes'] + est['peak']) / MB:.0f}"])
    head = ["layer", "rank", "peak RSS", "torch baseline", "fixture slice", "fixture stage (slice + temporaries)",
            "golden working set", "gather working set", "baseline + max(fixture stage, slice + golden, gather)"]
    return "MiB per rank\n\n" + _table(head, rows)


def report_threads(r: dict) -> str:
    rows = [[th, f"{w:.2f}"] for th, w in r["walls"].items()]
    return f"{r['case']}, {r['cores']} cores\n\n" + _table(["threads per rank", "wall s"], rows)


def report_loops(r: dict) -> str:
    rows = []
    for layer, m in r.items():
        for stage in m["base"]:
            rows.append([layer, stage, m["base"][stage]] + [f"{m[a][stage] - m['base'][stage]:+d}" for a in LOOP_AXES])
    return _table(["layer", "stage", "Python calls (tiny, tp=1, local_t=32)"] + [f"doubling {a}" for a in LOOP_AXES], rows)


def report_scaling(r: dict) -> str:
    parts = []
    for kind, label in (("tp", "tp"), ("local_t", "local_t")):
        xs = sorted({int(x) for s in r[kind].values() for x in s})
        rows = [[name] + [f"{s[x]:.2f}" if x in s else "" for x in xs] for name, s in r[kind].items()]
        parts.append(_table([label] + [str(x) for x in xs], rows))
    return "\n\n".join(parts)


# -- command line ----------------------------------------------------------------------------------
def _normalise(obj):
    """JSON round trip so that integer keys read back the same way in reports and the plot."""
    return json.loads(json.dumps(obj), object_hook=lambda d: {(int(k) if k.isdigit() else k): v for k, v in d.items()})


def merge_min(old: dict, new: dict) -> dict:
    """Scaling walls: per point, the minimum of this invocation's and the stored figures."""
    out = {"setup": new["setup"]}
    for kind in ("tp", "local_t"):
        out[kind] = {}
        for name in set(old.get(kind, {})) | set(new[kind]):
            a, b = old.get(kind, {}).get(name, {}), new[kind].get(name, {})
            out[kind][name] = {x: min(v for v in (a.get(x), b.get(x)) if v is not None) for x in set(a) | set(b)}
        out[kind] = dict(sorted(out[kind].items(), key=lambda kv: list(new[kind]).index(kv[0]) if kv[0] in new[kind] else 99))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["all", "launch", "sweep", "flash", "memory", "threads", "loops", "scaling", "plot",
                                     "golden-alone", "front"])
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the minimum is reported")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench"), help="folder for bench.json and scaling.png")
    ap.add_argument("--layers", default="swa,csa", help="layers of the memory and scaling benchmarks")
    ap.add_argument("--models", default="tiny,flash", help="models of the scaling benchmark")
    ap.add_argument("--layer", default="csa")
    ap.add_argument("--model", default="flash")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--local-t", type=int, default=64)
    ap.add_argument("--threads", type=int, default=CORES)
    ap.add_argument("--reference", default=None,
                    help="flash: also compare with the reference's own fixture + golden, from this pypto-lib checkout")
    ap.add_argument("--pairs", type=int, default=5, help="flash --reference: alternated pairs; the median ratio is reported")
    ap.add_argument("--reference-threads", type=int, default=None,
                    help="flash --reference: the reference golden's threads (PYPTO_GOLDEN_NUM_THREADS; default its own)")
    ap.add_argument("--merge", action="store_true",
                    help="scaling: keep, per point, the minimum with the figures already in bench.json")
    args = ap.parse_args()
    if args.what == "golden-alone":
        print(json.dumps(golden_alone(args.layer, args.model, args.tp, args.local_t, args.threads)))
        return 0
    if args.what == "plot":
        stored = json.load(open(os.path.join(args.out, "bench.json")))
        write_scaling_png(os.path.join(args.out, "scaling.png"), _normalise(stored["scaling"]))
        return 0
    layers = args.layers.split(",")
    todo = ["launch", "sweep", "flash", "memory", "threads", "loops", "scaling"] if args.what == "all" else [args.what]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {CORES} cores, min of {args.repeats} runs, "
          f"load average at start {os.getloadavg()[0]:.1f}\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp:
        for what in todo:
            if what == "launch":
                r = bench_launch(tmp, args.repeats)
            elif what == "sweep":
                r = bench_sweep(tmp, args.repeats)
            elif what == "flash":
                r = bench_flash(tmp, args.repeats, args.layer, args.tp, args.local_t,
                                args.reference and os.path.abspath(args.reference), args.pairs, args.reference_threads)
            elif what == "memory":
                r = bench_memory(tmp, layers)
            elif what == "threads":
                r = bench_threads(tmp, args.repeats, args.layer, args.tp, args.local_t)
            elif what == "loops":
                r = bench_loops(["swa", "csa", "hca"])
            elif what == "front":
                r = front_bench.bench_front(tmp, args.repeats, [str(ROOT)])
            else:
                r = bench_scaling(tmp, args.repeats, layers, args.models.split(","))
            r = _normalise(r)
            if what == "scaling" and args.merge and "scaling" in results:
                r = merge_min(_normalise(results["scaling"]), r)
            results[what] = r
            results[what + "_measured"] = {"at": time.strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
                                           "load": os.getloadavg()[0]}
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
            if what == "scaling":
                write_scaling_png(os.path.join(args.out, "scaling.png"), r)
            report = {"launch": report_launch, "sweep": report_sweep, "flash": report_flash, "memory": report_memory,
                      "threads": report_threads, "loops": report_loops, "scaling": report_scaling,
                      "front": front_bench.report_front}[what]
            print(f"## {what}\n\n{report(r)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
