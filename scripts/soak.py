"""Soak test: repeat a tiny sweep N times in one launcher process and count anything that drifts.

    python scripts/soak.py --rounds 20

Each round runs every attention layer at tiny dims at tp 1 and 4 and the MoE layer at ep 2, plus one run with an injected fault
(rank 1 raises) and one with a defective implementation, through the same in-process launcher
the pytest plugin uses (the forkserver stays warm, as in a sweep), in a child process whose temp
folder is a fresh one of its own. After each round it records the launcher's open file descriptors,
its RSS, its live descendant processes (ranks included) and the files in the temp folder; at
the end it reports hangs (a run slower than --hang-s), verdicts that changed between rounds
(flaky), the growth of fds, processes, temp files and RSS, and the temp files left once the
child has exited. Exit status 1 if any of those but RSS is found.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.pytest_plugin import run_layer  # noqa: E402

JOBS = [
    *[{"layer": layer, "tp": tp, "model": "tiny"} for layer in ("swa", "csa", "hca") for tp in (1, 4)],
    {"layer": "moe", "ep": 2, "model": "tiny"},
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


def _descendants() -> int:
    """Live processes below this launcher (ranks included: the forkserver forks them, and the
    warm ranks a passing job leaves), less the forkserver and the resource tracker themselves
    (its direct children, kept warm on purpose; a rank forked by the server has its command
    line too)."""
    parent, warm, me = {}, set(), os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z":
            pid = int(stat.parent.name)
            parent[pid] = int(fields[1])
            if (b"forkserver import main" in cmd or b"resource_tracker import main" in cmd) and parent[pid] == me:
                warm.add(pid)

    def below_me(pid: int) -> bool:
        while pid in parent:
            pid = parent[pid]
            if pid == me:
                return True
        return False

    return sum(below_me(pid) and pid not in warm for pid in parent)


def _temp_files(folder: str, outputs: str | None = None) -> int:
    """Files and folders under `folder`, less the runs' own output folder `outputs`."""
    n = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if os.path.join(root, d) != outputs]
        n += len(dirs) + len(files)
    return n


# Set for the soak itself, which runs in a child process whose temp folder is a fresh one.
TEMP_ENV = "DSV4_SOAK_TMPDIR"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--hang-s", type=float, default=60.0, help="a run slower than this counts as a hang")
    args = ap.parse_args()
    if TEMP_ENV in os.environ:
        return soak(args, os.environ[TEMP_ENV])
    # The soak runs in a child with a temp folder of its own (the forkserver and the ranks
    # inherit it), so that what is left in it once the child has exited is a leak too.
    temp_root = tempfile.mkdtemp(prefix="dsv4-soak-")
    try:
        status = subprocess.call([sys.executable, *sys.argv], env=dict(os.environ, TMPDIR=temp_root, **{TEMP_ENV: temp_root}))
        left = _temp_files(temp_root)
        print(f"temp files left after the soak's process exited: {left}")
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    return status or (1 if left else 0)


def soak(args, temp_root: str) -> int:
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
            samples.append((_fds(), _descendants(), _temp_files(temp_root, outputs=tmp), _rss_mb()))
            print(f"round {rnd + 1}/{args.rounds}: fds={samples[-1][0]} processes={samples[-1][1]} "
                  f"temp files={samples[-1][2]} rss={samples[-1][3]:.0f} MB", flush=True)
    flaky = {i: sorted(v) for i, v in verdicts.items() if len(v) > 1}
    warm = min(1, len(samples) - 1)  # by then the forkserver (and its temp folder) and imports are warm
    base = samples[warm]
    fd_growth, process_growth, temp_growth, rss_growth = (samples[-1][k] - base[k] for k in range(4))
    print(f"\nsoak: {args.rounds} rounds x {len(JOBS)} runs; slowest run {slowest:.1f} s; hangs {hangs}; "
          f"flaky verdicts {len(flaky)}{' ' + str(flaky) if flaky else ''}")
    print(f"after round {warm + 1}: processes {base[1]}, temp files {base[2]}; growth since: fds {fd_growth:+d}, "
          f"processes {process_growth:+d}, temp files {temp_growth:+d}, RSS {rss_growth:+.1f} MB")
    print("verdicts (exit codes) per job:", {i: sorted(v) for i, v in verdicts.items()})
    return 1 if hangs or flaky or fd_growth > 0 or process_growth > 0 or temp_growth > 0 else 0


if __name__ == "__main__":
    sys.exit(main())
