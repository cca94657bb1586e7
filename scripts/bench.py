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
    python scripts/bench.py prefill --reference PATH  # swa, hca prefill cp=2 real dims vs the reference's golden (bench_prefill.py)

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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # the bench_* modules and front_bench.py, beside this file

import front_bench  # noqa: E402
from bench_figures import bench_launch, bench_loops, bench_scaling, bench_sweep, bench_threads  # noqa: E402
from bench_golden import bench_flash, bench_memory, golden_alone  # noqa: E402
from bench_prefill import bench_prefill, report_prefill  # noqa: E402
from bench_report import (report_flash, report_launch, report_loops, report_memory, report_scaling,  # noqa: E402
                          report_sweep, report_threads, write_scaling_png)
from bench_runs import CORES  # noqa: E402


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
                                     "golden-alone", "front", "prefill"])
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the minimum is reported")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench"), help="folder for bench.json and scaling.png")
    ap.add_argument("--layers", default=None,
                    help="layers of the memory and scaling benchmarks (default swa,csa) and of prefill (swa,hca)")
    ap.add_argument("--models", default="tiny,flash", help="models of the scaling benchmark")
    ap.add_argument("--layer", default="csa")
    ap.add_argument("--model", default="flash")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--local-t", type=int, default=64)
    ap.add_argument("--threads", type=int, default=CORES)
    ap.add_argument("--reference", default=None,
                    help="flash: also compare with the reference's own fixture + golden, from this pypto-lib checkout")
    ap.add_argument("--pairs", type=int, default=5,
                    help="flash --reference, prefill: alternated pairs; the median ratio is reported")
    ap.add_argument("--reference-threads", type=int, default=None,
                    help="flash --reference, prefill: the reference golden's threads (PYPTO_GOLDEN_NUM_THREADS; "
                         "default its own)")
    ap.add_argument("--cp", type=int, default=2, help="prefill: the CP size")
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
    if args.what == "prefill" and not args.reference:
        raise SystemExit("prefill compares with the reference's golden: give --reference PATH (a pypto-lib checkout)")
    layers = (args.layers or ("swa,hca" if args.what == "prefill" else "swa,csa")).split(",")
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
            elif what == "prefill":
                r = bench_prefill(tmp, os.path.abspath(args.reference), layers,
                                  args.cp, args.pairs, args.reference_threads)
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
                      "front": front_bench.report_front, "prefill": report_prefill}[what]
            print(f"## {what}\n\n{report(r)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
