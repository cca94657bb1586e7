"""The launcher's front door timed: commands that print or refuse and start no rank.

    python scripts/bench.py front                        # this checkout, via bench.py
    python scripts/front_bench.py --repeats 7            # the same, alone
    python scripts/front_bench.py --checkouts OLD,NEW    # two checkouts side by side, alternated
    python scripts/front_bench.py --checkouts OLD,NEW --launch   # and tiny swa tp=8 end to end

Each command runs in a fresh interpreter (`PYTHONPATH=<checkout>`), from process start to exit;
the figures are the median wall and CPU (the process's and the children it waited for) of
`--repeats` runs, the commands and checkouts alternated round by round so that all see the
same load. Beside each: whether the process imported torch
(`-X importtime`), which a command that starts no rank should not pay for.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> the command line after `python`; {run} is a finished run folder, {tmp} a scratch folder.
COMMANDS = {
    "help": ["-m", "launcher", "--help"],
    "cfg": ["-m", "launcher", "--cfg", "job"],
    "refused key": ["-m", "launcher", "layr=swa", "hydra.run.dir={tmp}/refused"],
    "refused case": ["-m", "launcher", "layer=csa", "tp=3", "hydra.run.dir={tmp}/refused"],
    "sweep list": ["-m", "launcher.sweep", "list", "layer=swa,csa", "tp=1,2", "model=tiny"],
    "compare": ["-m", "launcher.compare", "{run}", "{run}"],
}
LAUNCH = ["-m", "launcher", "layer=swa", "tp=8", "model=tiny", "golden_cache=null", "hydra.run.dir={tmp}/launch{n}"]


def _env(checkout: str) -> dict:
    return {**os.environ, "PYTHONPATH": checkout}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(checkout: str, args: list[str], cwd: str) -> tuple[float, float, bool]:
    """(wall seconds, CPU seconds of the process and the children it waited for, whether torch
    was imported) of `python -X importtime ARGS` in `checkout`. The CPU figure moves less with
    the machine's load than the wall does."""
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    p = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=cwd, env=_env(checkout),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    return wall, cpu, any(line.rsplit("|", 1)[-1].strip() == "torch" for line in p.stderr.splitlines())


def bench_front(tmp: str, repeats: int, checkouts: list[str], launch: bool = False,
                only: list[str] | None = None) -> dict:
    run = os.path.join(tmp, "run")
    subprocess.run([sys.executable, "-m", "launcher", "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
                    f"hydra.run.dir={run}"], cwd=tmp, env=_env(checkouts[-1]), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    commands = dict(COMMANDS, **({"launch": LAUNCH} if launch else {}))
    commands = {k: v for k, v in commands.items() if only is None or k in only}
    walls = {(c, name): [] for c in checkouts for name in commands}
    cpus = {(c, name): [] for c in checkouts for name in commands}
    torch = {}
    for n in range(repeats):
        for name, args in commands.items():
            for c in checkouts if n % 2 == 0 else checkouts[::-1]:
                argv = [a.format(run=run, tmp=tmp, n=f"{n}-{checkouts.index(c)}") for a in args]
                wall, cpu, torch[c, name] = timed(c, argv, tmp)
                walls[c, name].append(wall)
                cpus[c, name].append(cpu)
    return {name: {c: {"median_s": statistics.median(walls[c, name]), "all_s": walls[c, name],
                       "median_cpu_s": statistics.median(cpus[c, name]), "imports_torch": torch[c, name]}
                   for c in checkouts} for name in commands}


def report_front(r: dict) -> str:
    checkouts = list(next(iter(r.values())))
    head = ["command"] + [f"{c}: median wall s / CPU s (torch?)" for c in checkouts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per in r.items():
        cells = [f"{per[c]['median_s']:.3f} / {per[c]['median_cpu_s']:.3f} "
                 f"({'torch' if per[c]['imports_torch'] else 'no torch'})" for c in checkouts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--checkouts", default=str(ROOT), help="comma-separated checkouts to time side by side")
    ap.add_argument("--launch", action="store_true", help="also time a tiny swa tp=8 run end to end (`launch`)")
    ap.add_argument("--only", default=None, help="comma-separated command names (help, cfg, launch, ...) to time alone")
    args = ap.parse_args()
    checkouts = [os.path.abspath(c) for c in args.checkouts.split(",")]
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, median of {args.repeats} runs, "
          f"load average at start {os.getloadavg()[0]:.1f}\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="dsv4-front-") as tmp:
        only = args.only.split(",") if args.only else None
        print(report_front(bench_front(tmp, args.repeats, checkouts, args.launch, only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
