"""One story per run: the console's VERDICT line, result.json's `decision`, the run page, the
sweep's table, map and JUnit say which check decided, the reference and integrity verdicts
side by side, and what was loosened (docs/verdict.md). Renderers fed given result dicts; the
end-to-end runs are tests/e2e/test_report.py's."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from launcher.report import console, sweep_summary
from launcher.report.result import exit_code, verdict, write_result
from launcher.report.run_page import render as render_page
from launcher.report.run_page import write_result_and_page
from launcher.report.sweep_page import write_sweep_page
from launcher.report.verdict import decision, line

CASE = {"layer": "swa", "scope": "full", "model": "tiny", "tp": 2, "local_t": 16, "seed": 1, "start_pos": None,
        "backend": "gloo", "impl": "layers.tp.TorchTP"}
X_OUT_LABEL = "ratio_reldiff(diff_thd=0.003, pct_thd=0.008, max_diff_hd=1)"


def _verdict(tensor: str, passed: bool, max_diff: float, diagnostic: bool = False, overridden=None,
             figures=None) -> dict:
    n_bad = 0 if passed else 40
    figures = {"n_bad": n_bad, "numel": 256, "max_abs_diff": max_diff, "worst": 0.0, **(figures or {})}
    per_rank = [{"rank": r, "n_bad": n_bad if r else 0, "numel": 128, "max_abs_diff": max_diff} for r in (0, 1)]
    return {"tensor": tensor, "passed": passed, "label": X_OUT_LABEL if tensor == "x_out" else f"cmp_{tensor}",
            "kind": "budget", "detail": "" if passed else f"cmp_{tensor} fail: error_count={n_bad}/256",
            "figures": figures, "per_rank": per_rank, "diagnostic": diagnostic, "overridden": overridden or {},
            "tally": {"n_bad": n_bad, "numel": 256, "max_abs_diff": max_diff, "worst": 0.0, "per_rank": per_rank}}


def _check(tensor: str, name: str, passed: bool) -> dict:
    return {"tensor": tensor, "check": name, "passed": passed, "summary": "" if passed else "1 value(s) beyond the cap",
            "detail": "" if passed else f"{name}: 1 value(s) beyond the cap (rank 1: 1)",
            "figures": {"n_bad": 0 if passed else 1, "numel": 8192, "per_rank": [0, 0 if passed else 1]}}


def _result(verdicts: list[dict], checks: list[dict] | None, tolerance: dict | None = None, passed=None) -> dict:
    """A run's result as `launcher.run.run_result.RunResult.launched` leaves it; checks None: integrity=false."""
    integrity = ({"enabled": False, "passed": None, "checks": []} if checks is None
                 else {"enabled": True, "passed": all(c["passed"] for c in checks), "checks": checks})
    reference_passed = not any(not v["passed"] and not v["diagnostic"] for v in verdicts)
    if passed is None:
        passed = reference_passed and integrity["passed"] is not False
    return {"case": CASE, "torch": "2.x", "host": "h", "wall_s": 1.0, "log_dir": None, "node_rank": 0, "status": "ok",
            "passed": passed, "reference": "golden", "verdicts": verdicts, "reference_passed": reference_passed,
            "integrity": integrity, "rank_seconds": [{"layer": 0.1}, {"layer": 0.1}],
            "golden_cache_hits": [], "golden_cache_problems": [], "rank_peak_rss_mib": [100.0, 100.0],
            "tolerance": {"profile": "default", "overridden": {}, "diagnostic": [], "not_applied": [],
                          **(tolerance or {})}}


def huge_value_in_cache() -> dict:
    """What HugeValueInCache leaves: both reference checks pass, the kv cache's cap fails."""
    return _result([_verdict("kv_cache", True, 1e30), _verdict("x_out", True, 0.0)],
                   [_check("kv_cache", "written_rows", True), _check("kv_cache", "finite", True),
                    _check("kv_cache", "cap", False), _check("x_out", "finite", True), _check("x_out", "cap", True)])


def _h1(page: str) -> str:
    (word,) = re.findall(r'<h1><span class="verdict v-(\w+)"', page)
    return word


def _summary(page: str) -> str:
    (text,) = re.findall(r'<p id="summary">([^<]*)</p>', page)
    return text


# -- a run that failed by integrity alone -------------------------------------------------------


def test_an_integrity_failure_is_the_verdict_everywhere():
    result = huge_value_in_cache()
    assert verdict(result) == "FAIL" and exit_code(result) == 1
    d = decision(result, "FAIL")
    assert d == {"verdict": "FAIL", "reference": "PASS", "integrity": "FAIL",
                 "failed": {"reference": [], "integrity": ["kv_cache cap"]}, "loosened": []}
    text = console.render(result)
    assert "VERDICT: FAIL by integrity (kv_cache cap); reference PASS (1.0s)" in text
    page = render_page(result)
    assert _h1(page) == "FAIL"
    assert _summary(page) == "FAIL by integrity (kv_cache cap); reference PASS"
    assert "all passed" not in page
    # The integrity section: its verdict, the table of checks, the failing check's account.
    assert 'id="integrity"' in page and 'id="integrity-table"' in page
    assert 'id="tensor-integrity_kv_cache-cap"' in page and "cap: 1 value(s) beyond the cap (rank 1: 1)" in page
    # The tensor's row says its integrity failed beside its passing reference verdict.
    assert 'data-tensor="kv_cache" data-verdict="PASS" data-integrity="FAIL"' in page
    assert 'data-tensor="x_out" data-verdict="PASS" data-integrity="PASS"' in page


def test_a_page_that_failed_both_ways_names_both():
    result = huge_value_in_cache()
    result["verdicts"][1] = _verdict("x_out", False, 0.18)
    result.update(reference_passed=False, passed=False)
    d = decision(result, verdict(result))
    assert d["failed"] == {"reference": ["x_out"], "integrity": ["kv_cache cap"]}
    assert line(d) == "FAIL by reference (x_out) and integrity (kv_cache cap)"
    page = render_page(result)
    assert _summary(page) == line(d) and 'id="integrity"' in page and "reference verdict: FAIL, integrity: FAIL" in page


def test_the_integrity_display_takes_whatever_checks_the_run_recorded():
    result = huge_value_in_cache()
    result["integrity"]["checks"].append(_check("x_out", "a_new_check", False))
    result["integrity"]["passed"] = False
    head = next(ln for ln in console.render(result).splitlines() if ln.startswith("integrity "))
    assert head.split() == ["integrity", "written_rows", "finite", "cap", "a_new_check"]
    page = render_page(result)
    assert "<th>a_new_check</th>" in page and 'id="tensor-integrity_x_out-a_new_check"' in page
    assert "integrity (kv_cache cap, x_out a_new_check)" in _summary(page)


def test_integrity_off_shows_on_the_page():
    result = _result([_verdict("kv_cache", True, 0.0), _verdict("x_out", True, 0.0)], None)
    page = render_page(result)
    assert 'id="integrity"' in page and "integrity=false" in page
    assert _summary(page) == "PASS; loosened: integrity=false"


# -- loosened checks ----------------------------------------------------------------------------


def _loosened_result() -> dict:
    changed = {"diff_thd": {"default": 0.003, "value": 1e6}}
    checks = [_check("x_out", "cap", True)]
    return _result([_verdict("kv_cache", True, 0.0), _verdict("x_out", True, 0.5, overridden=changed)], checks,
                   {"overridden": {"x_out": changed}})


def test_a_loosened_tolerance_is_in_the_verdict_line_the_page_and_junit(tmp_path):
    result = _loosened_result()
    assert verdict(result) == "PASS"
    expected = "PASS; loosened: x_out diff_thd=1e+06 (default 0.003)"
    assert f"VERDICT: {expected} (1.0s)" in console.render(result)
    assert _summary(render_page(result)) == expected
    written = write_result(str(tmp_path / "0"), result, {"num": 0, "overrides": ["tolerance.x_out.diff_thd=1e6"],
                                                         "sweep_id": None})
    assert written["decision"]["loosened"] == ["x_out diff_thd=1e+06 (default 0.003)"]
    row = sweep_summary.job_row(0, ["tolerance.x_out.diff_thd=1e6"], str(tmp_path / "0"), written)
    assert row["loosened"] == ["x_out diff_thd=1e+06 (default 0.003)"]
    assert row["message"] == "loosened: x_out diff_thd=1e+06 (default 0.003)"
    testcase = sweep_summary.junit_tree([row]).getroot().find("testsuite/testcase")
    props = {p.get("name"): p.get("value") for p in testcase.iter("property") if p.get("name") != "loosened"}
    assert props["verdict"] == expected
    assert [p.get("value") for p in testcase.iter("property") if p.get("name") == "loosened"] == [
        "x_out diff_thd=1e+06 (default 0.003)"]
    # The sweep's table lists a loosened PASS under its rows, as it lists a FAIL.
    assert f"job 0 PASS: {row['message']}  ({tmp_path / '0'})" in sweep_summary.table([row])


def test_a_tightened_tolerance_is_not_loosened():
    result = _loosened_result()
    result["tolerance"]["overridden"]["x_out"]["diff_thd"] = {"default": 0.003, "value": 1e-3}
    assert decision(result, "PASS")["loosened"] == [] and line(decision(result, "PASS")) == "PASS"


def test_a_diagnostic_failure_is_named_as_loosened_not_as_the_cause():
    """A diagnostic x_out that failed and a cap that failed too: the cap decided."""
    result = _result([_verdict("kv_cache", True, 0.0), _verdict("x_out", False, 1.0, diagnostic=True)],
                     [_check("x_out", "cap", False)], {"diagnostic": ["x_out"]})
    assert line(decision(result, verdict(result))) == (
        "FAIL by integrity (x_out cap); reference PASS; loosened: x_out diagnostic (FAIL, not counted)")


# -- nothing counts: UNCHECKED ------------------------------------------------------------------


def test_every_check_off_is_unchecked_never_pass(tmp_path):
    result = _result([_verdict("kv_cache", False, 0.5, diagnostic=True), _verdict("x_out", False, 0.18, diagnostic=True)],
                     None, {"diagnostic": ["kv_cache", "x_out"]})
    assert verdict(result) == "UNCHECKED" and exit_code(result) == 0
    text = console.render(result)
    assert "VERDICT: PASS" not in text and "reference verdict: PASS" not in text
    assert "reference verdict: off (every reference check is diagnostic: none fails the run), integrity: off" in text
    assert ("VERDICT: UNCHECKED: no check counts (kv_cache diagnostic (FAIL, not counted); "
            "x_out diagnostic (FAIL, not counted); integrity=false) (1.0s)") in text
    page = render_page(result)
    assert _h1(page) == "UNCHECKED" and _summary(page).startswith("UNCHECKED: no check counts")
    written = write_result(str(tmp_path / "0"), result, {"num": 0, "overrides": [], "sweep_id": None})
    row = sweep_summary.job_row(0, [], str(tmp_path / "0"), written)
    assert row["verdict"] == "UNCHECKED" and row["exit_code"] == 0 and row["message"].startswith("no check counts (")
    suite = sweep_summary.junit_tree([row]).getroot().find("testsuite")
    assert suite.get("skipped") == "1" and suite.get("failures") == "0"
    skipped = suite.find("testcase/skipped")
    assert skipped is not None and skipped.get("message").startswith("UNCHECKED: no check counts (")


def test_an_unchecked_job_does_not_stop_a_fail_fast_sweep(tmp_path):
    sweep_summary.start_record(str(tmp_path), [[], []])
    record = sweep_summary.read_record(str(tmp_path))
    # As RunResult.launched leaves it: a run no check could fail is not `passed`.
    result = _result([_verdict("x_out", True, 0.0, diagnostic=True)], None, {"diagnostic": ["x_out"]}, passed=False)
    write_result(str(tmp_path / "0"), result, {"num": 0, "overrides": [], "sweep_id": record["id"]})
    assert not sweep_summary.earlier_job_failed(str(tmp_path), 1)
    write_result(str(tmp_path / "0"), huge_value_in_cache(), {"num": 0, "overrides": [], "sweep_id": record["id"]})
    assert sweep_summary.earlier_job_failed(str(tmp_path), 1)


def test_diagnostic_checks_beside_integrity_checks_still_count():
    result = _result([_verdict("x_out", True, 0.0, diagnostic=True)], [_check("x_out", "cap", True)],
                     {"diagnostic": ["x_out"]})
    assert verdict(result) == "PASS"
    assert line(decision(result, "PASS")) == "PASS; reference off; loosened: x_out diagnostic"


# -- the sweep: impl, varying keys, the map ------------------------------------------------------


def _sweep(tmp_path: Path, results: list[dict], overrides: list[list[str]]) -> dict:
    sweep_dir = tmp_path / "sweep"
    sweep_summary.start_record(str(sweep_dir), overrides)
    sweep_id = sweep_summary.read_record(str(sweep_dir))["id"]
    for num, (result, given) in enumerate(zip(results, overrides)):
        write_result_and_page(str(sweep_dir / str(num)), result, {"num": num, "overrides": given, "sweep_id": sweep_id})
    rows = sweep_summary.collect_rows(str(sweep_dir))
    return {"sweep_dir": str(sweep_dir), "n_jobs": len(rows), "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
            "interrupted": False, "jobs": rows}


def test_jobs_that_differ_in_impl_alone_are_told_apart(tmp_path, capsys):
    impls = ["layers.tp.TorchTP", "tests.defects.HugeValueInCache"]
    results = [{**_result([_verdict("x_out", True, 0.0)], [_check("x_out", "cap", True)]), "case": {**CASE, "impl": i}}
               for i in impls]
    summary = _sweep(tmp_path, results, [["layer=swa", f"impl={i}"] for i in impls])
    lines = sweep_summary.table(summary["jobs"])
    assert "impl" in lines[0].split()
    assert [ln.split()[-1] for ln in lines[1:3]] != [] and all(i in ln for i, ln in zip(impls, lines[1:3]))
    assert console.varying_keys(summary["jobs"]) == ["impl"]
    page = Path(write_sweep_page(summary["sweep_dir"], summary)).read_text()
    assert '<code id="varies">impl</code>' in page and "<th>impl</th>" in page
    assert "impl=tests.defects.HugeValueInCache" in page[page.index('id="map"'):]
    sweep_summary.write_summary(summary["sweep_dir"])
    assert "sweep varies: impl" in capsys.readouterr().out


def test_one_impl_needs_no_impl_column(tmp_path):
    results = [{**_result([_verdict("x_out", True, 0.0)], [_check("x_out", "cap", True)]), "case": {**CASE, "tp": t}}
               for t in (1, 2)]
    summary = _sweep(tmp_path, results, [["layer=swa", f"tp={t}"] for t in (1, 2)])
    assert "impl" not in sweep_summary.table(summary["jobs"])[0].split()
    assert console.varying_keys(summary["jobs"]) == ["tp"]


def _map_cells(page: str) -> dict[tuple[str, str], tuple[str, bool]]:
    """(job, tensor) -> (fill, crossed) of the sweep page's map."""
    (figure,) = re.findall(r'<img alt="jobs x tensors map[^"]*" src="data:image/svg\+xml;base64,([^"]*)"', page)
    svg = base64.b64decode(figure).decode()
    fills = {(j, t): f for f, j, t in re.findall(r'fill="([^"]+)"[^>]*data-job="(\d+)" data-tensor="(\w+)"', svg)}
    crossed = set(re.findall(r'data-job="(\d+)" data-tensor="(\w+)">\u2716', svg))
    return {k: (f, k in crossed) for k, f in fills.items()}


def test_the_map_crosses_an_integrity_failure_and_scales_each_check_by_its_own_tolerance(tmp_path):
    band = {"diff_thd": 0.003}
    passing = _result([_verdict("x_out", True, 2.8e-4, figures=band)], [_check("x_out", "cap", True)])
    failing = _result([_verdict("x_out", False, 0.18, figures=band)], [_check("x_out", "cap", True)])
    huge = huge_value_in_cache()
    huge["verdicts"][0]["figures"]["tol_at_max"] = 0.007
    cells = _map_cells(Path(write_sweep_page(**_page(tmp_path / "a", [passing, failing, huge]))).read_text())
    assert cells[("2", "kv_cache")][1], "the integrity failure has its cross"
    assert not cells[("0", "x_out")][1] and cells[("1", "x_out")][1]
    # A passing sweep alone: its 2.8e-4 is drawn as it is beside a failing one, not as dark.
    alone = _map_cells(Path(write_sweep_page(**_page(tmp_path / "b", [passing]))).read_text())
    assert alone[("0", "x_out")][0] == cells[("0", "x_out")][0] != cells[("1", "x_out")][0]


def _page(tmp_path: Path, results: list[dict]) -> dict:
    summary = _sweep(tmp_path, results, [["layer=swa", f"seed={n}"] for n in range(len(results))])
    return {"sweep_dir": summary["sweep_dir"], "summary": summary}
