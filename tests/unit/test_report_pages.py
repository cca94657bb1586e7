"""The HTML pages as files: what each outcome's page says, that a page stands alone (no
network), its links, and the tables-only page where matplotlib is absent. What a browser makes
of them is tests/e2e/test_report_browser.py's."""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path

import pytest

from launcher.report import console, plots, svg
from launcher.report.run_page import render, write_page, write_result_and_page
from launcher.report.sweep_page import write_sweep_page

CASE = {"layer": "swa", "scope": "full", "model": "tiny", "tp": 2, "local_t": 16, "seed": 1, "start_pos": None,
        "backend": "gloo", "impl": "tests.defects.PerturbRankTokens"}


def grid(name: str, cols: str, bad: list[list[int]]) -> dict:
    n = len(bad[0])
    return {"name": name, "rows": "rank", "cols": cols, "cell": "", "col_labels": [str(i) for i in range(n)],
            "bad": bad, "numel": [[64] * n for _ in bad], "max_abs_diff": [[0.5 if b else 0.0 for b in row] for row in bad]}


def verdict(tensor: str, passed: bool, where: list | None = None) -> dict:
    n_bad = 0 if passed else 40
    return {"tensor": tensor, "passed": passed, "label": f"cmp_{tensor}(atol=0.001)", "kind": "budget",
            "detail": "" if passed else f"    cmp_{tensor} fail: error_count={n_bad}/256",
            "figures": {"n_bad": n_bad, "numel": 256, "max_abs_diff": 0.0 if passed else 0.75, "worst": 0.0},
            "per_rank": [{"rank": 0, "n_bad": 0, "numel": 128, "max_abs_diff": 0.0, "worst": 0.0},
                         {"rank": 1, "n_bad": n_bad, "numel": 128, "max_abs_diff": 0.0 if passed else 0.75,
                          "worst": 0.0}],
            **({"where": where} if where is not None else {})}


def ok_result(passed: bool, log_dir: str | None = None) -> dict:
    where = [grid("rank x token block", "token block", [[0, 0], [40, 0]]), grid("rank x hc", "hc", [[0, 0], [20, 20]])]
    return {"case": CASE, "torch": "2.x", "host": "h", "wall_s": 1.5, "log_dir": log_dir, "node_rank": 0,
            "status": "ok", "passed": passed, "reference": "golden",
            "verdicts": [verdict("kv_cache", True), verdict("x_out", passed, None if passed else where)],
            "rank_seconds": [{"fixture": 0.2, "golden": 0.1, "layer": 0.3, "gather": 0.05, "compare": 0.02},
                             {"fixture": 0.25, "golden": 0.1, "layer": 0.2}],
            "golden_cache_hits": [], "golden_cache_problems": [], "rank_peak_rss_mib": [210.5, 200.0]}


def not_run(status: str, message: str) -> dict:
    return {"case": CASE, "torch": "2.x", "host": "h", "wall_s": 0.1, "status": status, "passed": False,
            "error": {"rank": None, "phase": "config", "message": message, "traceback": "", "exitcode": None,
                      "log_dir": None, "other_ranks": []}}


def crashed() -> dict:
    return {"case": CASE, "torch": "2.x", "host": "h", "wall_s": 1.0, "log_dir": None, "status": "error",
            "passed": False, "error": {"rank": 1, "phase": "layer", "message": "RuntimeError: boom",
                                       "traceback": "Traceback (most recent call last):\nRuntimeError: boom",
                                       "exitcode": 1, "log_dir": None, "other_ranks": [0]}}


def h1_verdict(page: str) -> str:
    (word,) = re.findall(r'<h1><span class="verdict v-(\w+)" data-verdict="\1">\1</span>', page)
    return word


@pytest.mark.parametrize("result, word", [
    (ok_result(True), "PASS"),
    (ok_result(False), "FAIL"),
    (crashed(), "ERROR"),
    (not_run("config-error", "tp=3 must divide o_groups=8"), "ERROR"),
    (not_run("skipped", "not run: fail_fast=true"), "SKIP"),
    ({**ok_result(True), "verdicts": [], "compared_on_node": 0, "node_rank": 1, "passed": False}, "FAIL"),
    ({**ok_result(True), "verdicts": [], "reference": None, "passed": False, "unchecked": True}, "UNCHECKED"),
], ids=["pass", "fail", "error", "config-error", "skipped", "other-node", "golden-false"])
def test_every_outcome_has_a_page_with_its_own_verdict(result, word):
    page = render(result)
    assert h1_verdict(page) == word
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    if result["status"] != "ok":
        assert result["error"]["message"] in page


def test_a_failing_run_shows_fail_and_its_tensor_never_pass():
    page = render(ok_result(False))
    assert h1_verdict(page) == "FAIL" and 'data-verdict="PASS">PASS</span><span>' not in page
    assert 'data-tensor="x_out" data-verdict="FAIL"' in page and 'data-tensor="kv_cache" data-verdict="PASS"' in page
    assert "FAIL by reference (x_out)" in page
    assert 'href="#tensor-x_out"' in page and 'id="tensor-x_out"' in page  # the table links to the account
    assert "cmp_x_out fail: error_count=40/256" in page


def test_a_failing_tensor_gets_a_heat_map_per_grid_with_bad_points():
    pytest.importorskip("matplotlib")
    page = render(ok_result(False))
    alts = re.findall(r'<img alt="([^"]*)" src="data:image/([a-z+]*);base64,', page)
    assert alts == [("x_out rank x token block heat map", "png"), ("x_out rank x hc heat map", "png"),
                    ("phase times per rank", "svg+xml")]
    assert "figure not drawn" not in page


def test_a_page_stands_alone():
    """Nothing is fetched from anywhere: every image is a data: URI, no script, style or font
    comes from a URL, and the passing page has no script at all."""
    for result in (ok_result(True), ok_result(False), crashed()):
        page = render(result)
        assert not re.search(r"""(src|href)=["']?(https?:|//)""", page), "a network reference"
        assert "<script src" not in page and "@import" not in page and "url(" not in page
        assert all(src.startswith("data:") for src in re.findall(r'src="([^"]*)"', page))
        assert "<script" not in page


def test_log_links_are_relative_and_point_at_each_ranks_files(tmp_path):
    out = tmp_path / "run"
    for rank in (0, 1):
        d = out / "logs" / "swa-tp2-abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stdout.log").write_text(f"rank {rank} out\n")
        (d / "stderr.log").write_text(f"rank {rank} err\n")
    (out / "launcher.log").write_text("launcher\n")
    result = ok_result(True, log_dir=str(out / "logs"))
    write_result_and_page(str(out), result)
    page = (out / "report.html").read_text()
    hrefs = [h for h in re.findall(r'href="([^"#]*)"', page) if h and not h.startswith("data:")]
    assert "logs/swa-tp2-abc/attempt_0/1/stderr.log" in hrefs and "launcher.log" in hrefs and "result.json" in hrefs
    for h in hrefs:
        assert not os.path.isabs(h) and (out / h).is_file(), h
    moved = tmp_path / "moved"  # relative links survive moving the folder (a CI artifact)
    out.rename(moved)
    assert all((moved / h).is_file() for h in hrefs)


def test_a_crashed_rank_is_named_and_its_log_folder_marked(tmp_path):
    d = tmp_path / "logs" / "run" / "attempt_0" / "1"
    d.mkdir(parents=True)
    (d / "stderr.log").write_text("Traceback\n")
    result = crashed()
    result["log_dir"] = str(tmp_path / "logs")
    result["error"]["log_dir"] = str(d)
    page = render(result, str(tmp_path))
    assert "rank 1 failed in phase &#x27;layer&#x27; (exit code 1): RuntimeError: boom" in page
    assert "ranks also stopped: 0" in page and "failed here" in page
    assert 'href="logs/run/attempt_0/1/stderr.log"' in page


def test_a_schema_version_1_error_names_its_phase_from_its_stage_key(tmp_path):
    result = crashed()
    result["error"]["stage"] = result["error"].pop("phase")  # result.json of schema_version 1
    assert "rank 1 failed in phase &#x27;layer&#x27; (exit code 1)" in render(result, str(tmp_path))
    assert "rank 1 failed in phase 'layer' (exit code 1)" in console.render(result)


BENCH = {"rounds": 6, "warmup": 2, "min_s": 0.010, "median_s": 0.012, "mean_s": 0.0125, "max_s": 0.016,
         "per_rank": [{"min_s": 0.009, "median_s": 0.011, "mean_s": 0.0115, "max_s": 0.015},
                      {"min_s": 0.010, "median_s": 0.012, "mean_s": 0.0125, "max_s": 0.016}],
         "raw_s": [[0.009, 0.010], [0.011, 0.012], [0.012, 0.011], [0.015, 0.016], [0.010, 0.012], [0.011, 0.014]],
         "stages": [{"stage": "attention", "collective": False, "median_s": 0.006, "per_rank_median_s": [0.005, 0.006]},
                    {"stage": "reduce_scatter", "collective": True, "median_s": 0.002,
                     "per_rank_median_s": [0.002, 0.0015]}],
         "profiles": ["profile/rank0.json", "profile/rank1.json"]}


def test_a_benchmark_shows_its_figures_each_rank_and_a_histogram_of_the_rounds():
    page = render({**ok_result(True), "bench": BENCH})
    assert "6 timed rounds after 2 warm-up rounds" in page
    table = page[page.index('id="bench"'):page.index("</table>", page.index('id="bench"'))]
    assert [c for c in re.findall(r"<td[^>]*>([^<]*)</td>", table)] == [
        "min", "10 ms", "median", "12 ms", "mean", "12.5 ms", "max", "16 ms"]
    assert 'id="bench-ranks"' in page and "15 ms" in page
    stages = page[page.index('id="bench-stages"'):]
    assert re.findall(r"<tr><td>(\w+)</td><td>(\w*)</td><td class=num>([^<]*)</td><td class=num>([^<]*)</td>", stages) == [
        ("attention", "", "6 ms", "75%"), ("reduce_scatter", "collective", "2 ms", "25%")]
    assert '<a href="profile/rank1.json">profile/rank1.json</a>' in page
    assert plots.round_times(BENCH) == [0.010, 0.012, 0.012, 0.016, 0.012, 0.014]  # each round's slowest rank
    if plots.available():
        assert '<img alt="histogram of the benchmark rounds"' in page
        assert '<img alt="benchmark time per stage"' in page


def test_bisect_table_marks_the_first_divergent_stage():
    def cell(rank, passed, diff):
        return {"rank": rank, "passed": passed, "tensors": [{"chain": {"bitwise": diff == 0, "max_abs_diff": diff}}]}

    bisect = {"diverged": True, "stage": "reduce_scatter", "rank": 0, "ranks": [0, 1], "tensor": "attn_out",
              "mode": "isolated", "label": "ratio_allclose(...)", "detail": "    ratio_allclose fail", "stages": [
                  {"stage": "attention", "modes": ["isolated"] * 2, "passed": True, "failed_ranks": [],
                   "per_rank": [cell(0, True, 0), cell(1, True, 0)]},
                  {"stage": "reduce_scatter", "modes": ["isolated"] * 2, "passed": False, "failed_ranks": [0, 1],
                   "per_rank": [cell(0, False, 0.52), cell(1, False, 0.49)]}]}
    page = render({**ok_result(False), "bisect": bisect})
    assert "first divergence at stage &#x27;reduce_scatter&#x27; on rank 0 (ranks 0, 1), tensor attn_out" in page
    rows = re.findall(r'<tr( class="hit")?><td>(\w+)</td>', page[page.index('id="bisect"'):])
    assert rows[:2] == [("", "attention"), (' class="hit"', "reduce_scatter")]
    assert "<td class=num>0.52</td>" in page


def test_without_matplotlib_the_page_has_tables_and_says_how_to_get_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    plots.available.cache_clear()
    try:
        page = render({**ok_result(False), "bench": BENCH})
    finally:
        plots.available.cache_clear()
    assert h1_verdict(page) == "FAIL"
    # The phase times are SVG, drawn without matplotlib; the heat maps and benchmark charts are not.
    assert re.findall(r'<img alt="([^"]*)" src="data:image/svg\+xml;base64,', page) == ["phase times per rank"]
    assert page.count("<img") == 1 and "figure not drawn" not in page
    assert "matplotlib is not installed" in page and "pip install &#x27;dsv4-tp-harness[plots]&#x27;" in page
    assert "<details open><summary>where the bad points are, as text" in page  # the grids as text instead
    assert 'id="phase-times"' in page and 'id="bench"' in page
    # A passing run's page has no figure that needs matplotlib: nothing to say about it.
    plots.available.cache_clear()
    try:
        page = render(ok_result(True))
    finally:
        plots.available.cache_clear()
    assert "matplotlib" not in page and page.count("<img") == 1


def test_a_figure_that_fails_leaves_a_note_and_the_rest_of_the_page(monkeypatch):
    def broken(*args):
        raise ValueError("no such phase")

    monkeypatch.setattr(svg, "phase_times", broken)
    page = render(ok_result(True))
    assert "figure not drawn (phase times per rank): ValueError: no such phase" in page
    assert h1_verdict(page) == "PASS" and 'id="phase-times"' in page


def test_a_page_that_cannot_be_rendered_is_a_warning_not_the_runs_outcome(tmp_path, capsys):
    write_result_and_page(str(tmp_path), {"status": "ok", "passed": True})  # no case: the page cannot say what ran
    assert json.loads((tmp_path / "result.json").read_text())["passed"] is True
    assert not (tmp_path / "report.html").exists()
    assert "report.html not written: KeyError" in capsys.readouterr().err
    assert write_page(str(tmp_path / "absent" / "dir"), ok_result(True)) is None


def _sweep(tmp_path: Path) -> tuple[Path, dict]:
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.json").write_text("{}")  # the sweep's record comes before its jobs
    rows = []
    for num, (layer, result) in enumerate([("swa", ok_result(False)), ("swa", ok_result(True)),
                                           ("csa", crashed())]):
        out = sweep_dir / str(num)
        result = {**result, "case": {**CASE, "layer": layer}}
        write_result_and_page(str(out), result, {"num": num, "overrides": [f"layer={layer}"], "sweep_id": "x"})
        word = {"ok": "PASS" if result["passed"] else "FAIL"}.get(result["status"], "ERROR")
        rows.append({"job": num, "overrides": [f"layer={layer}"], "output_dir": str(out), "layer": layer,
                     "scope": "full", "model": "tiny", "tp": 2, "local_t": 16, "start_pos": None, "verdict": word,
                     "status": result["status"], "tensor": "x_out" if result["status"] == "ok" else None,
                     "max_abs_diff": 0.75 if word == "FAIL" else None, "n_bad": None, "wall_s": 1.0,
                     "message": "" if word == "PASS" else "something"})
    summary = {"sweep_dir": str(sweep_dir), "n_jobs": 3, "passed": 1, "failed": 1, "errors": 1, "skipped": 0,
               "interrupted": False, "jobs": rows}
    return sweep_dir, summary


def test_sweep_page_counts_links_filters_and_maps_the_jobs(tmp_path):
    sweep_dir, summary = _sweep(tmp_path)
    path = write_sweep_page(str(sweep_dir), summary)
    page = Path(path).read_text()
    assert h1_verdict(page) == "ERROR"  # the worst job's
    assert re.findall(r'<a href="([^"]*)">job (\d)</a>', page) == [
        ("0/report.html", "0"), ("1/report.html", "1"), ("2/report.html", "2")]
    assert all((sweep_dir / str(n) / "report.html").is_file() for n in range(3))
    for key in ("layer", "tp", "verdict"):
        assert f'<select id="filter-{key}" data-filter="{key}">' in page
    assert '<option value="csa">csa</option><option value="swa">swa</option>' in page
    assert 'data-layer="csa"' in page and 'data-verdict="ERROR"' in page
    map_table = page[page.index('id="map"'):]
    assert "<th>kv_cache</th><th>x_out</th>" in map_table and "0.75 FAIL" in map_table
    (figure,) = re.findall(r'<img alt="jobs x tensors map of max \|diff\| in tolerances" src="data:image/svg\+xml;base64,([^"]*)"', page)
    crossed = re.findall(r'data-job="(\d)" data-tensor="(\w+)">\u2716', base64.b64decode(figure).decode())
    assert crossed == [("0", "x_out")]
    # A job page links back to its sweep's page (the job folder sits in the sweep folder).
    assert '<a href="../report.html">the sweep</a>' in (sweep_dir / "0" / "report.html").read_text()


def test_several_tp_groups_get_a_table_each_with_global_ranks():
    good, bad = ok_result(True), ok_result(False)
    groups = [{"group": 0, "ranks": [0, 1], "seed": 1, "reference": "golden", "passed": True, "verdicts": good["verdicts"]},
              {"group": 1, "ranks": [2, 3], "seed": 7, "reference": "golden", "passed": False, "verdicts": bad["verdicts"]}]
    page = render({**bad, "case": {**CASE, "dp": 2}, "groups": groups})
    assert h1_verdict(page) == "FAIL" and "tp=2 · dp=2" in page and "dp=<code>2</code>" in page
    assert "FAIL by reference (group 1 x_out)" in page
    assert "group 0 (global ranks 0-1, seed 1): PASS" in page and "group 1 (global ranks 2-3, seed 7): FAIL" in page
    assert "<td>1 (global 3)</td>" in page
    assert page.count('id="tensor-group1_x_out"') == 1 and 'href="#tensor-group1_x_out"' in page
    assert 'id="tensor-group0_x_out"' not in page  # group 0 passed: no account, no grids


def test_sweep_page_shows_dp_only_where_a_job_had_several_groups(tmp_path):
    sweep_dir, summary = _sweep(tmp_path)
    page = Path(write_sweep_page(str(sweep_dir), summary)).read_text()
    assert 'id="filter-dp"' not in page and "<th>dp</th>" not in page
    summary["jobs"][0]["dp"] = 2
    page = Path(write_sweep_page(str(sweep_dir), summary)).read_text()
    assert '<select id="filter-dp" data-filter="dp">' in page and "<th>dp</th>" in page and 'data-dp="2"' in page


MOE_CASE = {"layer": "moe", "scope": "full", "model": "tiny", "ep": 2, "layer_id": 0, "num_tokens": 37,
            "balanced_routing": False, "seed": 1, "dp": 1, "backend": "gloo", "impl": "tests.defects.MoeRoutesToTheWrongRank"}


def test_a_moe_run_names_its_ep_case_not_tp():
    page = render({**ok_result(False), "case": MOE_CASE})
    assert h1_verdict(page) == "FAIL" and "moe full · tiny · ep=2</span></h1>" in page
    for key, value in (("ep", 2), ("layer_id", 0), ("num_tokens", 37), ("balanced_routing", False)):
        assert f"{key}=<code>{value}</code>" in page
    assert "tp=" not in page and "local_t=" not in page and "start_pos=" not in page
    assert "<title>FAIL moe ep=2 tiny</title>" in page


def test_a_moe_sweep_shows_and_filters_by_the_moe_case_keys(tmp_path):
    from launcher.report.sweep_summary import table

    sweep_dir, summary = _sweep(tmp_path)
    for row, tokens in zip(summary["jobs"], (37, 37, 128)):
        row.update(layer="moe", tp=None, local_t=None, ep=2, layer_id=0, num_tokens=tokens, balanced_routing=False)
    page = Path(write_sweep_page(str(sweep_dir), summary)).read_text()
    for key in ("ep", "layer_id", "num_tokens", "balanced_routing"):
        assert f'<select id="filter-{key}" data-filter="{key}">' in page and f"<th>{key}</th>" in page
    assert '<option value="37">37</option><option value="128">128</option>' in page and 'data-num_tokens="128"' in page
    for key in ("tp", "local_t", "start_pos"):  # an attention layer's keys: no MoE job has them
        assert f'id="filter-{key}"' not in page and f"<th>{key}</th>" not in page
    # The map names each job by its group size and the case keys the sweep varies.
    map_table = page[page.index('id="map"'):]
    assert "<td>0 moe tiny ep=2 num_tokens=37 FAIL</td>" in map_table and "layer_id=" not in map_table
    head = table(summary["jobs"])[0].split()
    assert head[:9] == ["job", "layer", "scope", "model", "ep", "layer_id", "num_tokens", "balanced_routing", "verdict"]
    # A sweep over both kinds of layer shows both kinds of key.
    summary["jobs"][2].update(layer="swa", tp=2, local_t=16, ep=None)
    page = Path(write_sweep_page(str(sweep_dir), summary)).read_text()
    assert all(f"<th>{key}</th>" in page for key in ("tp", "ep", "local_t", "num_tokens", "start_pos"))
