"""Soak test: repeat a tiny sweep N times in one launcher process and count anything that drifts.

    python scripts/soak.py --rounds 20

Each round runs every layer at tiny dims at tp 1 and 4, plus one run with an injected fault
(rank 1 raises) and one with a defective implementation, through the same in-process launcher
the pytest plugin uses (the forkserver stays warm, as in a sweep). After each round it records
the launcher's open file descriptors, its RSS, and its live child processes; at the end it
reports hangs (a run slower than --hang-s), verdicts that changed between rounds (flaky), and
the growth of fds, processes and RSS. Exit status 1 if any of those is found.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.pytest_plugin import run_layer  # noqa: E402

JOBS = [
    *[{"layer": layer, "tp": tp, "model": "tiny"} for layer in ("swa", "csa", "hca") for tp in (1, 4)],
    {"layer": "swa", "tp": 2, "model": "tiny", "overrides": ["fault.kind=raise", "fault.rank=1"]},
    {"layer": "swa", "tp": 2, "model": "tiny", "impl": "tests.defects.PerturbRankTokens"},
]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _children() -> int:
    """Live processes whose parent is this launcher, less the forkserver (kept warm on purpose)."""
    me, n = os.getpid(), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == me and b"forkserver" not in cmd and b"resource_tracker" not in cmd:
            n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--hang-s", type=float, default=60.0, help="a run slower than this counts as a hang")
    args = ap.parse_args()
    os.chdir(Path(__file__).resolve().parents[1])  # tests.defects must import in the ranks
    verdicts: dict[int, set] = {i: set() for i in range(len(JOBS))}
    samples, hangs, slowest = [], 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for i, job in enumerate(JOBS):
                keys = dict(job, golden_cache=None)
                overrides = keys.pop("overrides", [])
                t0 = time.perf_counter()
                run = run_layer(os.path.join(tmp, f"r{rnd}j{i}"), overrides=overrides, **keys)
                dt = time.perf_counter() - t0
                slowest = max(slowest, dt)
                hangs += dt > args.hang_s
                verdicts[i].add(run.exit_code)
            samples.append((_fds(), _children(), _rss_mb()))
            print(f"round {rnd + 1}/{args.rounds}: fds={samples[-1][0]} children={samples[-1][1]} "
                  f"rss={samples[-1][2]:.0f} MB", flush=True)
    flaky = {i: sorted(v) for i, v in verdicts.items() if len(v) > 1}
    base = samples[min(1, len(samples) - 1)]  # after the first round: the forkserver and imports are warm
    fd_growth, child_growth, rss_growth = (samples[-1][k] - base[k] for k in range(3))
    print(f"\nsoak: {args.rounds} rounds x {len(JOBS)} runs; slowest run {slowest:.1f} s; hangs {hangs}; "
          f"flaky verdicts {len(flaky)}{' ' + str(flaky) if flaky else ''}")
    print(f"growth after round 1: fds {fd_growth:+d}, child processes {child_growth:+d}, RSS {rss_growth:+.1f} MB")
    print("expected verdicts per job:", {i: sorted(v) for i, v in verdicts.items()})
    return 1 if hangs or flaky or fd_growth > 0 or child_growth > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
