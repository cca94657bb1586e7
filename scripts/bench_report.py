"""The benchmarks' figures as Markdown tables, and the scaling plot (matplotlib, the `plots` extra)."""

from __future__ import annotations

import sys
from pathlib import Path

from bench_figures import LOOP_AXES
from bench_runs import CORES, MB


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


