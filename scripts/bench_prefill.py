"""The prefill benchmark: `python -m launcher layer=<swa|hca> phase=prefill cp=2` at real dims
end to end against the public reference's own fixture + golden of the same case
(`scripts/reference_prefill_run.py`, importing a pypto-lib checkout), alternated pairs.

Each side is a fresh process. Per pair: the wall of each (process start to exit), the CPU of
each process tree (every process under this one while it runs, its utime + stime sampled from
/proc every 20 ms: the launcher, its helpers and ranks, or the reference's one process; the
ranks are not waited for by the launcher, so rusage would miss them), the ratio ours / reference of both
(below 1: ours is cheaper), our ranks' CPU in each stage (result.json's `rank_cpu_seconds`)
and the reference's split. The median of the pairs' ratios is reported: the load moves both
sides of a pair alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time

from bench_runs import ROOT, _descendants, run_launcher

STAGES = ("fixture", "golden", "layer", "compare")


class TreeCpu:
    """CPU-seconds of every process under this one while the block runs: each process's last
    sampled utime + stime (/proc/<pid>/stat), summed (a process's last period is missed)."""

    def __init__(self, period_s: float = 0.02):
        self.period_s, self.last, self._stop = period_s, {}, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.is_set():
            for pid in _descendants(os.getpid()):
                try:
                    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                self.last[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            time.sleep(self.period_s)

    def __enter__(self) -> "TreeCpu":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return sum(self.last.values())


def run_reference_prefill(reference: str, layer: str, cp: int, threads: int | None) -> tuple[float, float, dict]:
    """The reference's fixture + golden in a fresh process: (wall s, its tree's CPU s, its split)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "reference_prefill_run.py"), f"--reference={reference}",
           f"--layer={layer}", f"--cp={cp}"] + ([f"--threads={threads}"] if threads is not None else [])
    with TreeCpu() as cpu:
        t0 = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        wall = time.perf_counter() - t0
    return wall, cpu.seconds, json.loads(out.strip().splitlines()[-1])


def rank_stage_cpu(result: dict) -> list[dict[str, float]]:
    """Each rank's CPU-seconds per stage (fixture, golden, layer, compare) and their sum."""
    out = []
    for stages in result.get("rank_cpu_seconds") or []:
        per = {s: round(v, 2) for s, v in stages.items() if s in STAGES}
        out.append({**per, "total": round(sum(per.values()), 2)})
    return out


def bench_prefill(tmp: str, reference: str, layers: list[str], cp: int, pairs: int, threads: int | None) -> dict:
    out: dict = {"cp": cp, "model": "flash (real dims)", "reference_threads": threads, "layers": {}}
    for layer in layers:
        rows = []
        for i in range(pairs):
            load = os.getloadavg()[0]
            with TreeCpu() as cpu:
                ours = run_launcher(os.path.join(tmp, f"prefill-{layer}{i}"), [f"layer={layer}", "phase=prefill", f"cp={cp}"])
            ours_cpu = cpu.seconds
            theirs, theirs_cpu, split = run_reference_prefill(reference, layer, cp, threads)
            rows.append({"load": load, "ours_s": ours.wall_s, "ours_cpu_s": ours_cpu, "reference_s": theirs,
                         "reference_cpu_s": theirs_cpu, "ratio": ours.wall_s / theirs, "cpu_ratio": ours_cpu / theirs_cpu,
                         "ours_stages": ours.stage_walls(), "ours_rank_cpu": rank_stage_cpu(ours.result),
                         "reference": split})
            print(f"  {layer} pair {i + 1}/{pairs} (load {load:.1f}): ours {ours.wall_s:.1f} s / {ours_cpu:.1f} CPU-s, "
                  f"reference {theirs:.1f} s / {theirs_cpu:.1f} CPU-s, ratio {rows[-1]['ratio']:.2f} wall, "
                  f"{rows[-1]['cpu_ratio']:.2f} CPU", file=sys.stderr, flush=True)
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        out["layers"][layer] = {"pairs": rows, "median_ratio": med("ratio"), "median_cpu_ratio": med("cpu_ratio"),
                                "median_ours_s": med("ours_s"), "median_reference_s": med("reference_s")}
    return out


def report_prefill(r: dict) -> str:
    lines = [f"cp={r['cp']}, {r['model']}; reference golden threads: {r['reference_threads'] or 'its default'}", "",
             "| layer | pair | load | ours wall / CPU | reference wall / CPU | ratio wall | ratio CPU | our ranks' CPU (fixture, golden, layer, compare) |",
             "|---|---|---|---|---|---|---|---|"]
    for layer, res in r["layers"].items():
        for i, p in enumerate(res["pairs"]):
            ranks = "; ".join(", ".join(f"{c.get(s, 0):.1f}" for s in STAGES) for c in p["ours_rank_cpu"])
            lines.append(f"| {layer} | {i + 1} | {p['load']:.1f} | {p['ours_s']:.1f} s / {p['ours_cpu_s']:.1f} s | "
                         f"{p['reference_s']:.1f} s / {p['reference_cpu_s']:.1f} s | {p['ratio']:.2f} | "
                         f"{p['cpu_ratio']:.2f} | {ranks} |")
        lines.append(f"| {layer} | median | | {res['median_ours_s']:.1f} s | {res['median_reference_s']:.1f} s | "
                     f"{res['median_ratio']:.2f} | {res['median_cpu_ratio']:.2f} | |")
    return "\n".join(lines)


__all__ = ["TreeCpu", "run_reference_prefill", "rank_stage_cpu", "bench_prefill", "report_prefill"]
