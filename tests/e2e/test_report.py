"""The per-run report: where a failing tensor's errors are (grids, text, PNG heat maps).

The grids are checked against loop-by-loop restatements of the gates (validation.md §8.2 for
pools, §10.2 for ratio_reldiff) written here; the heat maps through the figure matplotlib
draws (its axes, colour bar, marked cell), the PNG files by decoding them.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from launcher.report.console import render
from launcher.report import plots
from launcher.report.sweep_summary import job_row
from launcher.report.sweep_summary import table as sweep_table
from launcher.verify import mapped_pool_ratio_allclose, ratio_reldiff
from launcher.verify.base import initial_key
from launcher.verify.where import error_maps, tally
from layers.contract.checks import HIDDEN_AXES, PoolCheck, RelDiffCheck

from .. import defects
from ..conftest import REPO

RELDIFF = RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=1.0, axes=HIDDEN_AXES)
POOL = PoolCheck("kv_cache", mapping="slot_mapping", block_size=4, atol=1e-4, rtol=1 / 128)


def _naive_reldiff_bad(a: float, e: float, thd: float) -> bool:
    if not (abs(a) < float("inf") and abs(e) < float("inf")):  # NaN or Inf on either side
        return True
    diff = abs(a - e)
    floor = (1.0 / (1 << 14)) / thd
    rdiff = diff if diff < thd else diff / (max(abs(a), abs(e), floor) + 1e-9)
    return rdiff > thd


def test_x_out_grids_count_what_the_gate_counts():
    g = torch.Generator().manual_seed(0)
    p, t, hc, d = 2, 32, 4, 16
    e = torch.rand(p, t, hc, d, generator=g) * 2 - 1
    a = e.clone()
    a[1, 8:16] *= 1.5  # rank 1, the second request: bad everywhere it is not tiny
    a[0, 3, 2, 5] += 0.1  # one point of rank 0, token block 0, hc 2
    a[0, 20, 1, 0] = float("nan")
    a[1, 30, 3, 7] += 1e-5  # inside the tolerance
    maps = error_maps("x_out", RELDIFF, a, e, {}, seq=8)
    blocks, hcs = maps[0], maps[1]
    assert (blocks["name"], hcs["name"]) == ("rank x token block", "rank x hc")
    assert blocks["col_labels"] == ["0-7", "8-15", "16-23", "24-31"]
    want_blocks = [[0] * 4 for _ in range(p)]
    want_hc = [[0] * hc for _ in range(p)]
    for r in range(p):
        for tok in range(t):
            for h in range(hc):
                for c in range(d):
                    if _naive_reldiff_bad(float(a[r, tok, h, c]), float(e[r, tok, h, c]), RELDIFF.diff_thd):
                        want_blocks[r][tok // 8] += 1
                        want_hc[r][h] += 1
    assert blocks["bad"] == want_blocks
    assert hcs["bad"] == want_hc
    assert blocks["numel"] == [[8 * hc * d] * 4] * p
    assert want_blocks[1][1] > 0 and want_blocks[0][0] == 1 and want_blocks[0][2] == 1
    assert blocks["max_abs_diff"][0][0] == pytest.approx(0.1, rel=1e-4)
    assert blocks["max_abs_diff"][0][2] == 0.0  # the NaN point is bad but has no finite diff


def test_token_blocks_span_whole_requests_and_tiles():
    a = torch.zeros(1, 48, 4, 2)
    maps = error_maps("x_out", RELDIFF, a, a.clone(), {}, seq=12)  # lcm(12, 8) = 24
    assert maps[0]["col_labels"] == ["0-23", "24-47"]


def test_pool_grid_counts_mapped_misses_and_stray_writes_per_physical_block():
    g = torch.Generator().manual_seed(1)
    p, nb, bs, heads, w = 2, 4, 4, 3, 5
    e = torch.rand(p, nb, bs, heads, w, generator=g)
    a = e.clone()
    mapping = torch.tensor([[0, 5, 6, 13, -1, -1], [2, 3, 9, 15, 14, -1]])
    a[0, 1, 1, 2, :] += 0.5  # row 5 of rank 0 (mapped), head 2: out of tolerance
    a[0, 2, 3, 0, 1] += 0.5  # row 11 of rank 0 (not mapped): a stray write
    a[1, 0, 2, 1, 0] += 1e-6  # row 2 of rank 1 (mapped): inside the tolerance
    a[1, 3, 3, :, :] = float("nan")  # row 15 of rank 1 (mapped): non-finite
    maps = error_maps("kv_cache", POOL, a, e, {"slot_mapping": mapping})
    blocks, head_map = maps
    assert (blocks["name"], head_map["name"]) == ("rank x physical block", "rank x head")
    want_blocks = [[0] * nb for _ in range(p)]
    want_heads = [[0] * heads for _ in range(p)]
    for r in range(p):
        mapped = {int(s) for s in mapping[r] if s >= 0}
        for row in range(nb * bs):
            blk, intra = divmod(row, bs)
            for h in range(heads):
                for c in range(w):
                    x, y = float(a[r, blk, intra, h, c]), float(e[r, blk, intra, h, c])
                    if row in mapped:
                        finite = abs(x) < float("inf") and abs(y) < float("inf")
                        bad = not finite or abs(x - y) > POOL.atol + POOL.rtol * abs(y)
                    else:
                        bad = x != y
                    if bad:
                        want_blocks[r][blk] += 1
                        want_heads[r][h] += 1
    assert blocks["bad"] == want_blocks
    assert head_map["bad"] == want_heads
    assert want_blocks == [[0, w, 1, 0], [0, 0, 0, heads * w]]


def _row_of(tensor: str, check, a: torch.Tensor, e: torch.Tensor, inputs: dict, comparator) -> tuple[dict, dict]:
    """A verdict as the worker records it (figures, where, tally) and its sweep summary row."""
    v = comparator.evaluate(a, e, inputs=inputs)
    verdict = {"tensor": tensor, **v.to_dict(), "where": error_maps(tensor, check, a, e, inputs)}
    verdict["tally"] = tally(verdict, check, a.shape)
    result = {"case": {"layer": "swa"}, "status": "ok", "passed": False, "wall_s": 1.0, "verdicts": [verdict],
              "reference_passed": False, "integrity": {"enabled": True, "passed": True, "checks": []}}
    return verdict, job_row(0, [], "out", result)


def test_a_golden_that_writes_stray_rows_has_a_row_that_counts_them():
    """The comparator's own n_bad counts mapped values only (0 here); the row counts what the
    detail and the grids count: every changed value of the rows the golden wrote outside the step."""
    e = torch.rand(2, 4, 4, 3, 5, generator=torch.Generator().manual_seed(2))
    a, before = e.clone(), e.clone()
    mapping = torch.tensor([[0, 5, 6, -1], [2, 3, 9, 15]])
    e[1, 2, 0] += 1.0  # row 8 of rank 1, not mapped: the golden wrote it (15 values)
    cmp = mapped_pool_ratio_allclose("slot_mapping", mapping_shape=(2, 4), block_size=4, leading_rank_axis=True,
                                     atol=POOL.atol, rtol=POOL.rtol, initial_name=initial_key("kv_cache"))
    inputs = {"slot_mapping": mapping, initial_key("kv_cache"): before}
    verdict, row = _row_of("kv_cache", POOL, a, e, inputs, cmp)
    assert not verdict["passed"] and verdict["category"] == "golden" and verdict["figures"]["n_bad"] == 0
    assert (row["n_bad"], row["numel"], row["max_abs_diff"]) == (15, a.numel(), pytest.approx(1.0))
    assert sum(map(sum, verdict["where"][0]["bad"])) == 15
    assert [r["n_bad"] for r in verdict["tally"]["per_rank"]] == [0, 15]
    assert "0/" not in render_row(row)


def test_a_nan_row_counts_its_nan_points():
    """fault.kind=nan: 8192 NaN in x_out; the comparator counts finite points only (n_bad 0)."""
    e = torch.rand(2, 64, 4, 32, generator=torch.Generator().manual_seed(3))
    a = e.clone()
    a[1, :8] = float("nan")
    verdict, row = _row_of("x_out", RELDIFF, a, e, {}, ratio_reldiff(3e-3, 0.008, 1, rank_axis=True))
    assert verdict["figures"]["n_bad"] == 0 and verdict["figures"]["nan_actual"] == 8 * 4 * 32
    assert (row["n_bad"], row["numel"], row["worst"]) == (8 * 4 * 32, a.numel(), None)
    assert f"{8 * 4 * 32}/{a.numel()}" in render_row(row)
    per_rank = [ln.split()[:3] for ln in render(_result_of(verdict)).splitlines() if ln.split()[1:2] in (["ok"], ["bad"])]
    assert per_rank == [["0", "ok", f"0/{a[0].numel()}"], ["1", "bad", f"1024/{a[1].numel()}"]]


def render_row(row: dict) -> str:
    return "\n".join(sweep_table([row]))


def _result_of(verdict: dict) -> dict:
    return {"case": {"layer": "swa", "model": "tiny", "tp": 2, "local_t": 64, "seed": 1, "start_pos": None,
                     "backend": "gloo", "impl": "x"},
            "status": "ok", "passed": False, "wall_s": 1.0, "rank_seconds": [{}, {}], "verdicts": [verdict],
            "reference_passed": False, "integrity": {"enabled": False, "passed": None, "checks": []}}


def test_a_shape_mismatch_has_no_grid():
    assert error_maps("x_out", RELDIFF, torch.zeros(2, 8, 4, 4), torch.zeros(2, 8, 4, 5), {}) == []


def _png_size(data: bytes) -> tuple[int, int]:
    """A PNG's size, read with Pillow (which decodes the whole image, so a broken file raises)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img.size


def test_heat_map_has_labelled_axes_a_colour_bar_and_the_worst_cell_marked():
    pytest.importorskip("matplotlib")
    grid = {"name": "rank x token block", "rows": "rank", "cols": "token block", "cell": "8 tokens",
            "col_labels": ["0-7", "8-15", "16-23"], "bad": [[0, 3, 0], [12, 0, 1]],
            "numel": [[64] * 3] * 2, "max_abs_diff": [[0.0, 0.5, 0.0], [0.25, 0.0, 0.75]]}
    fig = plots.heatmap("x_out", grid)
    ax, bar = fig.axes  # the map and its colour bar
    assert ax.get_xlabel() == "token block (8 tokens each)" and ax.get_ylabel() == "rank"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0-7", "8-15", "16-23"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]  # rank 0 on top: imshow's first row
    assert bar.get_ylabel() == "bad points in the cell"
    assert "worst (\u2605): rank 1, token block 0-7: 12/64 bad, max|diff| 0.25" in ax.get_title()
    (outline,) = [p for p in ax.patches if p.get_label() == "worst cell"]
    assert outline.get_xy() == (-0.5, 0.5)  # column 0, row (rank) 1
    (star,) = ax.lines
    assert list(star.get_xdata()) == [0] and list(star.get_ydata()) == [1]
    image = ax.images[0].get_array()
    assert image.mask.tolist() == [[True, False, True], [False, True, False]]  # grey where no bad point
    assert plots.worst_cell(grid) == (1, 0)
    assert _png_size(plots.png(fig))[0] > 300


def test_worst_cell_ties_go_to_the_larger_diff():
    grid = {"bad": [[5, 5]], "max_abs_diff": [[0.1, 0.2]]}
    assert plots.worst_cell(grid) == (0, 1)


def _failing_result() -> dict:
    a = torch.zeros(2, 16, 4, 8)
    e = a.clone()
    a[1, 0:8] = 1.0
    where = error_maps("x_out", RELDIFF, a, e, {}, seq=8)
    verdicts = [
        {"tensor": "kv_cache", "passed": True, "label": "pool", "detail": "", "figures": {"n_bad": 0}, "per_rank": []},
        {"tensor": "x_out", "passed": False, "label": "ratio_reldiff(...)", "detail": "    ratio_reldiff fail",
         "figures": {"n_bad": 256, "numel": 1024}, "per_rank": [], "where": where},
    ]
    verdicts[0]["tally"] = tally(verdicts[0], POOL, (2, 4, 4, 8))
    verdicts[1]["tally"] = tally(verdicts[1], RELDIFF, a.shape)
    return {"case": {"layer": "swa", "model": "tiny", "tp": 2, "local_t": 16, "seed": 1, "start_pos": None,
                     "backend": "gloo", "impl": "x"},
            "status": "ok", "passed": False, "wall_s": 1.0, "rank_seconds": [{"fixture": 0.1}, {"fixture": 0.1}],
            "verdicts": verdicts, "reference_passed": False, "integrity": {"enabled": True, "passed": True, "checks": []}}


def test_render_says_where_the_bad_points_are():
    text = render(_failing_result())
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if "where: x_out: 256 bad points per rank and token block" in ln)
    assert lines[head + 1].split() == ["token", "block", "0-7", "8-15"]
    assert lines[head + 2].split() == ["rank", "0", ".", "."]
    assert lines[head + 3].split() == ["rank", "1", "256", "."]
    assert "worst: rank 1, token block 0-7: 256/256 bad" in text


def test_plots_only_for_failing_tensors(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.write_plots(_failing_result(), str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["heatmap_x_out_rank_x_hc.png",
                                                          "heatmap_x_out_rank_x_token_block.png"]
    assert all(_png_size(open(p, "rb").read())[0] > 300 for p in paths)


def test_plots_without_matplotlib_write_nothing_and_say_how_to_get_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    plots.available.cache_clear()
    try:
        assert plots.write_plots(_failing_result(), str(tmp_path)) == []
    finally:
        plots.available.cache_clear()
    assert os.listdir(tmp_path) == []
    assert "pip install 'dsv4-tp-harness[plots]'" in capsys.readouterr().err


def test_a_defective_rank_is_located_end_to_end(tp_run):
    """Real ranks: rank 1 perturbs its first request (tokens 0-7), so exactly that cell is bad."""
    run = tp_run(layer="swa", tp=2, model="tiny", impl=defects.PerturbRankTokens, overrides=["report.plots=true"])
    assert run.exit_code == 1, run
    blocks = next(g for g in run.verdict("x_out")["where"] if g["name"] == "rank x token block")
    assert blocks["bad"][0] == [0] * 8
    assert blocks["bad"][1][0] > 0 and blocks["bad"][1][1:] == [0] * 7
    assert "where: x_out" in run.report
    png = os.path.join(run.output_dir, "heatmap_x_out_rank_x_token_block.png")
    if plots.available():
        assert run.result["plots"] and png in run.result["plots"]
        assert _png_size(open(png, "rb").read())[0] > 300
    else:
        assert run.result["plots"] == []


def test_each_rank_phase_has_its_wall_and_its_cpu_time(tp_run):
    """result.json's `rank_cpu_seconds` is each phase's CPU, not its wall: in the layer phase
    rank 0 computes for 0.3 s, rank 1 sleeps as long; the report's table shows both."""
    run = tp_run(layer="swa", tp=2, model="tiny", impl=defects.BusyOnRank0IdleOnRank1)
    assert run.exit_code == 0, run
    wall, cpu = run.result["rank_seconds"], run.result["rank_cpu_seconds"]
    assert [set(c) for c in cpu] == [set(w) for w in wall]
    assert cpu[0]["layer"] >= 0.3 and wall[0]["layer"] >= 0.3
    assert wall[1]["layer"] >= 0.3 and cpu[1]["layer"] < 0.15
    assert all(0 <= c[s] for c in cpu for s in c)
    page = open(os.path.join(run.output_dir, "report.html")).read()
    assert "<th>CPU s</th>" in page.split('id="phase-times"')[1].split("</table>")[0]


def _bench_module(monkeypatch, name: str):
    """One of scripts/bench.py's modules, imported as bench.py imports it (from scripts/)."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    return importlib.import_module(name)


def test_bench_scaling_plot_has_both_panels_on_log_axes(monkeypatch):
    """scripts/bench_report.py's scaling plot: wall time against tp and against local_t, drawn by matplotlib."""
    pytest.importorskip("matplotlib")
    bench = _bench_module(monkeypatch, "bench_report")
    scaling = {"tp": {"tiny swa": {1: 1.6, 2: 1.8, 4: 2.0, 8: 2.2}, "flash csa": {1: 4.0, 2: 5.0, 4: 8.6, 8: 17.1}},
               "local_t": {"tiny swa": {8: 1.7, 16: 1.8}, "flash csa": {16: 4.4, 64: 5.0, 256: 8.9}}}
    fig = bench.scaling_figure(scaling)
    left, right = fig.axes
    assert (left.get_xlabel(), right.get_xlabel()) == ("tp", "local_t (tokens per rank)")
    assert left.get_xscale() == right.get_xscale() == "log" and left.get_yscale() == "log"
    assert [t.get_text() for t in left.get_xticklabels()] == ["1", "2", "4", "8"]
    assert [t.get_text() for t in right.get_xticklabels()] == ["8", "16", "64", "256"]
    assert [ln.get_label() for ln in left.lines] == ["tiny swa", "flash csa"]
    assert list(right.lines[1].get_ydata()) == [4.4, 5.0, 8.9]
    assert _png_size(plots.png(fig))[0] == 1200


def test_bench_sweep_phases_cut_at_each_jobs_first_and_last_event(monkeypatch):
    """scripts/bench_runs.py's sweep breakdown: start-up, the jobs' stages, between jobs, exit."""
    bench = _bench_module(monkeypatch, "bench_runs")
    ev = lambda t: {"t": t}  # noqa: E731
    run = bench.SweepRun(wall_s=10.0, started=100.0, jobs=[[ev(102.0), ev(101.5), ev(103.0)], [ev(103.5), ev(106.0)]])
    phases = run.phases()
    assert phases == {"start-up": 1.5, "stages": 4.0, "between jobs": 0.5, "exit": 4.0}
    assert sum(phases.values()) == run.wall_s


def test_bench_counts_the_machines_busy_time_and_the_sweeps_cpu_budget(monkeypatch):
    """scripts/bench.py's CPU figures: /proc/stat's busy time covers a CPU-bound child, and
    the sweep table sets the two sides' CPU against what the target's wall would offer."""
    bench = _bench_module(monkeypatch, "bench_runs")
    report = _bench_module(monkeypatch, "bench_report")
    if bench._busy_core_s() is None:
        pytest.skip("no /proc/stat")
    before = bench._busy_core_s()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert bench._busy_since(before) >= 0.45  # the child's own CPU at least: every process counts
    figures = {"one_s": 2.0, "warm_s": 3.5, "cold_s": 4.0, "ratio": 1.75, "target": 1.5, "cold_ratio": 2.0,
               "one_busy_core_s": 3.4, "warm_busy_core_s": 6.6}
    rows = report.report_sweep(figures).splitlines()
    cores = bench.CORES
    assert f"| CPU of the one run (busy core-s of the {cores * 2.0:.2f} its wall offered) | 3.40 |" in rows
    assert f"| CPU of the sweep (busy core-s of the {cores * 3.5:.2f} its wall offered) | 6.60 |" in rows
    assert f"| core-s a sweep at the target could use at most ({cores} cores x 1.5 x one run) | {cores * 3.0:.2f} |" in rows
    assert not any("CPU" in row for row in report.report_sweep({**figures, "warm_busy_core_s": None}).splitlines())
    assert not any("golden cache" in row for row in rows)  # a bench.json from before the warm-cache pair
    cached = report.report_sweep({**figures, "one_cached_s": 1.9, "warm_cached_s": 3.1, "cached_ratio": 1.63})
    assert "| with a filled golden cache: one run / the sweep | 1.90 / 3.10 |" in cached.splitlines()
    assert "| ratio with a filled golden cache | 1.63 |" in cached.splitlines()
    assert not any("stage CPU" in row for row in rows)  # a bench.json from before the ranks' CPU
    stages = report.report_sweep({**figures, "one_stage_cpu_s": 0.5, "warm_stage_cpu_s": 2.5}).splitlines()
    assert "| the ranks' CPU in their stages (fixture .. compare), core-s: one run / the sweep | 0.50 / 2.50 |" in stages
    assert (f"| the sweep's extra jobs' stage CPU over {cores} cores (their wall at best) / the target's room "
            f"(0.5 x one run), s | {2.0 / cores:.2f} / 1.00 |") in stages
    cached = report.report_sweep({**figures, "one_cached_s": 1.9, "warm_cached_s": 3.1, "cached_ratio": 1.63,
                                 "one_cached_stage_cpu_s": 0.3, "warm_cached_stage_cpu_s": 1.5}).splitlines()
    assert (f"| the sweep's extra jobs' stage CPU over {cores} cores (their wall at best), filled golden cache / "
            f"the target's room (0.5 x one run), s | {1.2 / cores:.2f} / 0.95 |") in cached
    assert not any("around the ranks' stages" in row for row in rows)  # no phases given
    phases = {"start-up": 1.5, "stages": 1.0, "between jobs": 0.75, "exit": 0.25}
    around = report.report_sweep({**figures, "phases": phases, "one_phases": {**phases, "stages": 0.5}}).splitlines()
    assert ("| the launcher's time around the ranks' stages, s: one run / the sweep (wall less the stages) "
            "| 1.50 / 2.50 |") in around
    assert "| ratio of the two | 1.67 |" in around
    per_rank = {"rank_cpu_seconds": [{"fixture": 0.25, "layer": 0.5}, {"layer": 0.125}]}
    assert bench._stage_cpu_s(per_rank) == 0.875 and bench._stage_cpu_s({}) is None


def test_console_report_of_a_node_without_rank_0():
    """A node other than 0 prints rank 0's verdict (the name `verdict` is the rule, not a local)."""
    result = {**_failing_result(), "verdicts": [], "compared_on_node": 0, "node_rank": 1, "passed": True}
    assert render(result).splitlines()[-2:] == ["node 1: rank 0 on node 0 compared; its verdict: PASS",
                                                "VERDICT: PASS (1.0s)"]


def test_bench_prefill_counts_the_cpu_of_every_process_under_it(monkeypatch):
    """scripts/bench_prefill.py: the process tree's CPU covers a CPU-bound grandchild (the
    launcher's ranks are not waited for, so rusage would miss them), and the table gives
    each pair's ratios and each rank's stage CPU."""
    prefill = _bench_module(monkeypatch, "bench_prefill")
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    grandchild = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {spin!r}]).wait()"
    with prefill.TreeCpu() as cpu:
        subprocess.run([sys.executable, "-c", grandchild], check=True)
    assert cpu.seconds >= 0.4, cpu.last
    pair = {"load": 3.0, "ours_s": 20.0, "ours_cpu_s": 18.0, "reference_s": 40.0, "reference_cpu_s": 36.0, "ratio": 0.5,
            "cpu_ratio": 0.5, "ours_rank_cpu": [{"fixture": 1.0, "golden": 3.0, "layer": 3.0, "compare": 2.0}] * 2}
    table = prefill.report_prefill({"cp": 2, "model": "flash", "reference_threads": 2,
                                    "layers": {"hca": {"pairs": [pair], "median_ratio": 0.5, "median_cpu_ratio": 0.5,
                                                       "median_ours_s": 20.0, "median_reference_s": 40.0}}})
    assert "| hca | 1 | 3.0 | 20.0 s / 18.0 s | 40.0 s / 36.0 s | 0.50 | 0.50 | 1.0, 3.0, 3.0, 2.0; 1.0, 3.0, 3.0, 2.0 |" in table
    assert "| hca | median | | 20.0 s | 40.0 s | 0.50 | 0.50 | |" in table
