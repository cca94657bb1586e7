"""The launcher's time around its jobs' compute: a sweep's against one run's, as a user runs them.

For one tiny swa tp=8 run and for `-m +sweep=smoke` (six tiny jobs), both `golden_cache=null`,
each started as a fresh `python -m launcher` from the current folder (or `--cwd`: run it from
a folder outside the repository, with the project installed as you use it, editable or not):

    overhead = wall - sum over the jobs of the slowest rank's summed stage walls (result.json's
               `rank_seconds`)

and the ratio overhead(sweep) / overhead(one run): what five extra jobs add to one launch
beyond their own compute. The two sides are alternated `--repeats` times; the minimum of each
is reported (the machine is shared: the least disturbed run of each side).

    python scripts/sweep_overhead.py --repeats 5 --cwd /tmp/elsewhere
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ONE_RUN = ["layer=swa", "tp=8", "model=tiny", "golden_cache=null"]
SWEEP = ["-m", "+sweep=smoke", "golden_cache=null"]


def _compute_seconds(folder: str) -> float:
    """The jobs' compute under `folder`: per job, its slowest rank's summed stage walls."""
    total = 0.0
    for path in glob.glob(os.path.join(folder, "**", "result.json"), recursive=True):
        with open(path) as f:
            ranks = json.load(f)["rank_seconds"]
        total += max(sum(stages.values()) for stages in ranks)
    return total


def _timed(args: list[str], out_key: str, cwd: str) -> tuple[float, float]:
    """(wall, compute) of one `python -m launcher ARGS` in `cwd`, its results in a fresh folder."""
    folder = tempfile.mkdtemp(prefix="overhead-", dir=cwd)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "launcher", *args, f"{out_key}={folder}"], cwd=cwd,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(args)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return wall, _compute_seconds(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cwd", default=os.getcwd(), help="the folder the launcher starts in (default: this one)")
    args = ap.parse_args()
    sides = {"one run": (ONE_RUN, "hydra.run.dir"), "sweep": (SWEEP, "hydra.sweep.dir")}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, (cmd, key) in sides.items():
            figures[name].append(_timed(cmd, key, args.cwd))
    best = {}
    print(f"from {args.cwd}, min of {args.repeats} (wall, compute, overhead = wall - compute), s:")
    for name, runs in figures.items():
        wall, compute = min(runs, key=lambda r: r[0] - r[1])
        best[name] = wall - compute
        print(f"  {name:8s} {wall:6.2f} {compute:6.2f} {wall - compute:6.2f}")
    print(f"overhead ratio sweep / one run: {best['sweep'] / best['one run']:.2f}")


if __name__ == "__main__":
    main()
