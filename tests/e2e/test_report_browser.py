"""The report's pages in a real headless Chromium, as a person would use them: real runs at tiny
dims (a passing one, a failing one, a crashed one, a refused config, a benchmark, the MoE
layer's passing and failing) and a real multirun, loaded from disk; no console error, the
verdict, the tensor names, every image decoded, the links working, a screenshot that is not
blank. The last test feeds the same checks wrong pages
and expects each wrong thing to be caught.

Needs /usr/bin/chromium and /usr/bin/chromedriver (Debian: chromium, chromium-driver) and
selenium; skipped with the reason where they are absent, except where DSV4_REQUIRE_BROWSER=1
(CI) makes their absence a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.report import plots
from launcher.report.run_page import render

from .. import browser, defects
from ..conftest import REPO
from ..unit.test_report_pages import ok_result

_MISSING = browser.missing()
if _MISSING and os.environ.get("DSV4_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"DSV4_REQUIRE_BROWSER=1 but no browser: {_MISSING}")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"no headless Chromium: {_MISSING}")

# A page as a person sees it has text, tables, badges and (with matplotlib) figures: many
# colours and a fair share of the screen that is not white. A blank or unstyled page has not.
MIN_COLOURS = 40 if plots.available() else 8
MIN_INK = 0.04


@pytest.fixture(scope="module")
def driver():
    with browser.chromium() as d:
        yield d


def _check(driver, path, *, verdict: str, texts: list[str], min_images: int, shot: Path) -> browser.Page:
    page = browser.open_page(driver, path)
    assert browser.page_problems(page, verdict=verdict, texts=texts, min_images=min_images) == []
    png = browser.full_screenshot(driver)
    shot.write_bytes(png)
    distinct, ink = browser.colours(png)
    assert distinct >= MIN_COLOURS and ink >= MIN_INK, f"{shot}: {distinct} colours, {ink:.1%} not white"
    return page


def _images(matplotlib: int, svg: int = 1) -> int:
    """How many images a page has: its SVG figures, and matplotlib's where it is installed."""
    return svg + (matplotlib if plots.available() else 0)


# The figures the harness writes as SVG, on every page; the others need matplotlib.
SVG_FIGURES = ("phase times per rank", "jobs x tensors map of max |diff| in tolerances")


def _alts(page: browser.Page, expected: list[str]) -> None:
    """The page's images in order: `expected`, less matplotlib's where it is not installed."""
    assert [i["alt"] for i in page.images] == [a for a in expected if a in SVG_FIGURES or plots.available()]


def test_a_passing_run_page(tp_run, driver, tmp_path):
    run = tp_run(layer="swa", tp=2, model="tiny")
    assert run.passed, run
    page = _check(driver, Path(run.output_dir) / "report.html", verdict="PASS", min_images=_images(0),
                  texts=["x_out", "kv_cache", "reference verdict: PASS, integrity: PASS", "phase times per rank", "rank 1"],
                  shot=tmp_path / "pass.png")
    _alts(page, ["phase times per rank"])
    # Each rank's logs are linked; a link opens the log itself.
    logs = [ln for ln in page.links if ln["raw"].startswith("logs/")]
    assert {ln["raw"].split("/")[-2] for ln in logs} == {"0", "1"}
    assert all(ln["raw"].endswith((".log", ".json")) for ln in logs)
    text = ""
    for ln in logs:
        if ln["raw"].split("/")[-2] == "0":
            driver.get(ln["href"])
            text += driver.execute_script("return document.body.innerText")
    assert "phase fixture" in text


def test_a_failing_run_page(tp_run, driver, tmp_path):
    run = tp_run(layer="swa", tp=2, model="tiny", impl=defects.PerturbRankTokens)
    assert run.exit_code == 1, run
    page = _check(driver, Path(run.output_dir) / "report.html", verdict="FAIL", min_images=_images(2),
                  texts=["x_out", "kv_cache", "FAIL by reference (x_out)", "ratio_reldiff fail", "rank x token block"],
                  shot=tmp_path / "fail.png")
    _alts(page, ["x_out rank x token block heat map", "x_out rank x hc heat map", "phase times per rank"])
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('tr.tensor')).map(r => [r.dataset.tensor, r.dataset.verdict])")
    assert rows == [["kv_cache", "PASS"], ["x_out", "FAIL"]]
    # The failing tensor's name in the table leads to its account.
    driver.find_element("link text", "x_out").click()
    assert driver.current_url.endswith("#tensor-x_out")
    assert browser.console_errors(driver) == []


def test_a_page_that_failed_by_integrity_alone(tp_run, driver, tmp_path):
    """Both reference verdicts pass, the cap fails: the page says FAIL, names the check, and
    the tensor's row shows its integrity beside its reference verdict."""
    run = tp_run(layer="swa", tp=2, model="tiny", impl=defects.HugeValueInCache)
    assert run.exit_code == 1, run
    _check(driver, Path(run.output_dir) / "report.html", verdict="FAIL", min_images=_images(0),
           texts=["FAIL by integrity (kv_cache cap); reference PASS", "kv_cache integrity cap", "integrity"],
           shot=tmp_path / "integrity.png")
    rows = driver.execute_script("return Array.from(document.querySelectorAll('tr.tensor'))"
                                 ".map(r => [r.dataset.tensor, r.dataset.verdict, r.dataset.integrity])")
    assert rows == [["kv_cache", "PASS", "FAIL"], ["x_out", "PASS", "PASS"]]
    driver.find_element("link text", "cap").click()
    assert driver.current_url.endswith("#tensor-integrity_kv_cache-cap")
    # A wide window is filled: the page is no column in the middle of a white screen.
    driver.set_window_size(2400, 1000)
    width = driver.execute_script("return [document.querySelector('main').getBoundingClientRect().width, window.innerWidth]")
    assert width[0] >= 0.9 * width[1], width


def test_moe_run_pages(tp_run, driver, tmp_path):
    """The MoE layer's pages: its case by ep, x_next with a row per rank, and for a failing run
    (every route sent to the wrong rank) its rank x token block and rank x hc heat maps."""
    passed = tp_run(layer="moe", ep=2, model="tiny")
    failed = tp_run(layer="moe", ep=2, model="tiny", impl=defects.MoeRoutesToTheWrongRank)
    assert (passed.exit_code, failed.exit_code) == (0, 1), (passed, failed)
    case = ["moe full · tiny · ep=2", "layer_id=0", "balanced_routing=False"]
    _check(driver, Path(passed.output_dir) / "report.html", verdict="PASS", min_images=_images(0),
           texts=[*case, "x_next", "reference verdict: PASS, integrity: PASS", "phase times per rank"], shot=tmp_path / "moe.png")
    page = _check(driver, Path(failed.output_dir) / "report.html", verdict="FAIL", min_images=_images(2),
                  texts=[*case, "MoeRoutesToTheWrongRank", "FAIL by reference (x_next)", "ratio_reldiff fail",
                         "rank x token block", "rank x hc"], shot=tmp_path / "moe-fail.png")
    assert "tp=" not in page.text
    _alts(page, ["x_next rank x token block heat map", "x_next rank x hc heat map", "phase times per rank"])
    ranks = driver.execute_script("return Array.from(document.querySelectorAll('#primary-verdicts tr'))"
                                  ".map(r => Array.from(r.cells).slice(0, 3).map(c => c.innerText))")
    assert ranks[1:] == [["x_next", "all", "FAIL"], ["", "0", "bad"], ["", "1", "bad"]]


def test_error_pages_of_a_crashed_rank_and_a_refused_config(tp_run, driver, tmp_path):
    crashed = tp_run(layer="swa", tp=2, model="tiny", overrides=["fault.kind=raise", "fault.rank=1"])
    refused = tp_run(layer="swa", tp=3, model="tiny")
    assert (crashed.exit_code, refused.exit_code) == (2, 2)
    page = _check(driver, Path(crashed.output_dir) / "report.html", verdict="ERROR", min_images=0,
                  texts=["rank 1 failed in phase 'layer'", "InjectedFault", "traceback", "failed here"],
                  shot=tmp_path / "crashed.png")
    assert any(ln["raw"].endswith("/1/stderr.log") for ln in page.links)
    browser.open_page(driver, Path(refused.output_dir) / "report.html")
    page = browser.read(driver)
    assert browser.page_problems(page, verdict="ERROR", texts=["refused before any rank started", "tp=3 must divide",
                                                                "No rank ran"]) == []


def test_a_sweep_page_and_its_links(driver, tmp_path):
    sweep_dir = tmp_path / "sweep"
    impls = "tests.defects.PerturbRankTokens,layers.tp.TorchTP"
    p = subprocess.run([sys.executable, "-m", "launcher", "-m", "layer=swa", "model=tiny", "tp=2",
                        f"impl._target_={impls}", f"hydra.sweep.dir={sweep_dir}"],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "summary.json, junit.xml and report.html in" in p.stdout
    page = _check(driver, sweep_dir / "report.html", verdict="FAIL", min_images=_images(0),
                  texts=["1 passed", "1 failed", "0 errors", "x_out", "2 of 2 jobs shown"], shot=tmp_path / "sweep.png")
    _alts(page, ["jobs x tensors map of max |diff| in tolerances"])

    def shown():
        return driver.execute_script(
            "return Array.from(document.querySelectorAll('#jobs tbody tr')).filter(r => !r.hidden)"
            ".map(r => [r.dataset.job, r.dataset.verdict])")

    assert shown() == [["0", "FAIL"], ["1", "PASS"]]
    driver.execute_script("const s = document.getElementById('filter-verdict'); s.value = 'PASS';"
                          "s.dispatchEvent(new Event('change'));")
    assert shown() == [["1", "PASS"]]
    assert "1 of 2 jobs shown" in driver.find_element("id", "shown").text
    driver.execute_script("const s = document.getElementById('filter-verdict'); s.value = '';"
                          "s.dispatchEvent(new Event('change'));")
    assert len(shown()) == 2
    # A job's link opens that job's own page, by a relative path.
    link = driver.find_element("link text", "job 0")
    assert link.get_attribute("href").endswith("/sweep/0/report.html") and not os.path.isabs(
        link.get_dom_attribute("href"))
    link.click()
    job = browser.read(driver)
    assert job.url.endswith("/sweep/0/report.html")
    assert browser.page_problems(job, verdict="FAIL", texts=["x_out", "sweep job 0", "PerturbRankTokens"],
                                 min_images=_images(2)) == []
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert [j["verdict"] for j in summary["jobs"]] == ["FAIL", "PASS"]


def test_a_benchmark_page(tp_run, driver, tmp_path):
    """Benchmark mode with stage times: the figures, each rank's, a histogram of the rounds and
    where a round's time goes."""
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=["bench.rounds=6", "bench.warmup=1", "bench.stages=true"])
    assert run.passed, run
    page = _check(driver, Path(run.output_dir) / "report.html", verdict="PASS", min_images=_images(2),
                  texts=["benchmark", "6 timed rounds after 1 warm-up round;", "where a round's time goes",
                         "group_all_to_all", "collective"], shot=tmp_path / "bench.png")
    _alts(page, ["phase times per rank", "histogram of the benchmark rounds", "benchmark time per stage"])


def test_the_checks_catch_a_wrong_page(driver, tmp_path):
    """Each check fails on a page that is wrong in its way: the wrong verdict, a missing tensor,
    an image that does not decode, a script error, a blank page."""
    good = render(ok_result(False))
    cases = {
        "verdict": good.replace('data-verdict="FAIL">FAIL</span><span>', 'data-verdict="PASS">PASS</span><span>', 1),
        "tensor": good.replace("x_out", "x_o\u200but"),
        "image": good.replace("data:image/svg+xml;base64,PHN2Zy", "data:image/svg+xml;base64,AAAAAA", 1),
        "script": good.replace("</body>", "<script>undefinedFunction();</script></body>"),
    }
    want = {"verdict": "verdict badge says 'PASS'", "tensor": "text 'x_out' not on the page",
            "image": "did not decode", "script": "console error"}
    for name, text in cases.items():
        path = tmp_path / f"{name}.html"
        path.write_text(text)
        page = browser.open_page(driver, path)
        problems = browser.page_problems(page, verdict="FAIL", texts=["x_out"], min_images=_images(2))
        assert any(want[name] in p for p in problems), (name, problems)
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    browser.open_page(driver, blank)
    distinct, ink = browser.colours(browser.full_screenshot(driver))
    assert distinct < MIN_COLOURS and ink < MIN_INK
