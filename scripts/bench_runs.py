"""Running the launcher for the benchmarks: one run or one sweep as a fresh process, timed from
start to exit, with its result.json, the ranks' stage events, the ranks' peak RSS (sampled from
/proc while it runs) and the machine's busy CPU while it ran."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 1
MB = 2**20

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
            lo_hi = spans.setdefault(ev["phase"], [math.inf, -math.inf])
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

