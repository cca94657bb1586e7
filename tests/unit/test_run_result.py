"""RunResult: a run's result built once, with one `passed` (`run_passes`), the rule the ranks
broadcast their verdict by too; result.json keeps its keys."""

from types import SimpleNamespace

from launcher.config.verdict_words import run_passes
from launcher.report.result import exit_code, verdict
from launcher.run.run_result import RunResult
from launcher.run.worker import _passed

PASS = {"tensor": "x_out", "passed": True}
FAIL = {"tensor": "x_out", "passed": False}
MEASURED = {"tensor": "x_out", "passed": False, "diagnostic": True}
MACHINE = {"backend": "gloo", "devices": ["cpu"]}


def _spec(dp: int = 1):
    case = SimpleNamespace(model=SimpleNamespace(fields=lambda: {"hidden_size": 64}))
    return SimpleNamespace(case_entry=lambda: {"layer": "swa", "tp": 2}, case=case, threads=lambda: 1, slot=None,
                           snapshot=None, tolerances=SimpleNamespace(entry=lambda checks: {}),
                           layer=SimpleNamespace(checks=lambda case: ()), node_rank=0, golden_data=None,
                           save_data=None, dp=dp)


def _rank_result(*groups):
    return {"reporting": True, "passed": None, "bench": None, "rank_seconds": [{}], "rank_cpu_seconds": [{}],
            "golden_cache_hits": [], "input_cache_hits": [], "golden_cache_problems": [], "rank_peak_rss_mib": [1.0],
            "rank_cpus": [None],
            "groups": [{"group": g, "ranks": [g], "seed": 0, "comparisons": {"golden": verdicts},
                        "integrity": {"golden": checks} if checks is not None else None, "bisect": None}
                       for g, (verdicts, checks) in enumerate(groups)]}


def _built(*groups, dp: int = 1) -> dict:
    return RunResult.launched(_spec(dp), machine=MACHINE, rank_result=_rank_result(*groups), error=None,
                              log_dir="logs", wall_s=1.0).to_json()


def test_the_one_rule():
    assert run_passes([PASS], []) is True
    assert run_passes([PASS, FAIL], []) is False
    assert run_passes([PASS], [{"passed": False}]) is False
    assert run_passes([PASS, MEASURED], [{"passed": True}]) is True
    assert run_passes([MEASURED], []) is None  # no check counts: UNCHECKED


def test_a_failing_group_fails_the_run_and_is_the_one_shown():
    result = _built(([PASS], None), ([FAIL], None), dp=2)
    assert result["passed"] is False and result["verdicts"] == [FAIL]
    assert [g["passed"] for g in result["groups"]] == [True, False]
    assert verdict(result) == "FAIL" and exit_code(result) == 1


def test_a_failing_integrity_check_fails_a_run_whose_references_pass():
    result = _built(([PASS], [{"passed": False}]))
    assert result["passed"] is False and result["reference_passed"] is True
    assert result["integrity"]["passed"] is False and verdict(result) == "FAIL"


def test_a_run_no_check_could_fail_never_reads_as_passed():
    result = _built(([MEASURED], None))
    assert result["passed"] is False and verdict(result) == "UNCHECKED"


def test_the_ranks_verdict_and_the_results_agree():
    for verdicts, checks in [([PASS], None), ([FAIL], None), ([PASS], [{"passed": False}]), ([MEASURED], None)]:
        integrity = [{"golden": checks} if checks is not None else None]
        assert bool(_passed([{"golden": verdicts}], integrity)) == _built((verdicts, checks))["passed"]


def test_a_result_writes_only_the_keys_it_has():
    refused = RunResult.not_launched({"layer": "swa"}, "config-error", "bad key", wall_s=0.01234, phase="config")
    assert set(refused.to_json()) == {"case", "status", "passed", "wall_s", "error"}
    assert refused.to_json()["wall_s"] == 0.012 and refused.to_json()["error"]["phase"] == "config"
    launched = _built(([PASS], None))
    assert "groups" not in launched and "snapshot" not in launched and "rank_figures" not in launched
    assert launched["rank_peak_rss_mib"] == [1.0] and launched["golden_cache_problems"] == []
