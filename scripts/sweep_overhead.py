"""The launcher's time around its jobs' compute: a sweep's against one run's, as a user runs them.

For one tiny swa tp=8 run and for `-m +sweep=smoke` (six tiny jobs), both `golden_cache=null`,
each started as a fresh `python -m launcher` from the current folder (or `--cwd`: run it from
a folder outside the repository, with the project installed as you use it, editable or not):

    overhead = wall - sum over the jobs of the slowest rank's summed stage walls (result.json's
               `rank_seconds`)

and the ratio overhead(sweep) / overhead(one run): what five extra jobs add to one launch
beyond their own compute. The two sides are alternated `--repeats` times; the minimum of each
is reported (the machine is shared: the least disturbed run of each side), with the median
beside it. `--pythons` alternates installs too (each interpreter's own `launcher`, e.g. an
editable and a plain install's venvs), so that every figure sees the same load. Beside the
wall: the CPU of the launcher process itself (its own threads, not the forkserver's or the
ranks'), which a loaded machine disturbs far less than the wall.

    python scripts/sweep_overhead.py --repeats 5 --cwd /tmp/elsewhere
    python scripts/sweep_overhead.py --cwd /tmp/elsewhere --pythons EDITABLE/bin/python,PLAIN/bin/python
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ONE_RUN = ["layer=swa", "tp=8", "model=tiny", "golden_cache=null"]
SWEEP = ["-m", "+sweep=smoke", "golden_cache=null"]
SIDES = {"one run": (ONE_RUN, "hydra.run.dir"), "sweep": (SWEEP, "hydra.sweep.dir")}


def _compute_seconds(folder: str) -> float:
    """The jobs' compute under `folder`: per job, its slowest rank's summed stage walls."""
    total = 0.0
    for path in glob.glob(os.path.join(folder, "**", "result.json"), recursive=True):
        with open(path) as f:
            ranks = json.load(f)["rank_seconds"]
        total += max(sum(stages.values()) for stages in ranks)
    return total


def _timed(python: str, args: list[str], out_key: str, cwd: str) -> tuple[float, float, float]:
    """(wall, compute, the launcher process's own CPU) of one `python -m launcher ARGS` in
    `cwd`, its results in a fresh folder there, removed once read (kept when the run failed)."""
    folder = tempfile.mkdtemp(prefix="overhead-", dir=cwd)
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([python, "-m", "launcher", *args, f"{out_key}={folder}"], cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            sys.exit(f"{python} -m launcher {' '.join(args)} exited {proc.returncode}:\n{log.read()[-3000:]}")
    compute = _compute_seconds(folder)
    shutil.rmtree(folder)
    return wall, compute, usage.ru_utime + usage.ru_stime


def _where(python: str, cwd: str) -> str:
    """Where `python` imports the launcher from, started in `cwd` (an editable install: the checkout)."""
    code = "import launcher, os; print(os.path.dirname(os.path.dirname(launcher.__file__)))"
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cwd", default=os.getcwd(), help="the folder the launcher starts in (default: this one)")
    ap.add_argument("--pythons", default=sys.executable,
                    help="comma-separated interpreters, alternated (default: this one)")
    args = ap.parse_args()
    pythons = args.pythons.split(",")
    figures = {(py, side): [] for py in pythons for side in SIDES}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for py in pythons:
            for side, (cmd, key) in SIDES.items():
                figures[py, side].append(_timed(py, cmd, key, args.cwd))
    load.append(os.getloadavg()[0])
    print(f"from {args.cwd}, {args.repeats} alternated repeats, load average {load[0]:.1f} -> {load[1]:.1f}")
    for py in pythons:
        print(f"\n{py} (launcher from {_where(py, args.cwd)}), s:")
        print(f"  {'':8s} {'wall':>6s} {'compute':>8s} {'overhead':>8s} {'median':>7s} {'launcher CPU':>13s}")
        best, cpu = {}, {}
        for side in SIDES:
            runs = figures[py, side]
            wall, compute, _ = min(runs, key=lambda r: r[0] - r[1])
            best[side] = wall - compute
            cpu[side] = min(r[2] for r in runs)
            median = statistics.median(r[0] - r[1] for r in runs)
            print(f"  {side:8s} {wall:6.2f} {compute:8.2f} {wall - compute:8.2f} {median:7.2f} {cpu[side]:13.2f}")
        print(f"  overhead ratio sweep / one run: {best['sweep'] / best['one run']:.2f} (min), "
              f"launcher CPU ratio {cpu['sweep'] / cpu['one run']:.2f}")


if __name__ == "__main__":
    main()
