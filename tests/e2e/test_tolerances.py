"""Tolerances as configuration: overrides of any check's tolerance parameters, diagnostic checks,
named profiles (the reference's simulator profile among them), and how every report shows the
effective comparator; bad names refused with the valid ones."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.run.preflight import preflight
from launcher.store import snapshot
from layers.contract.config import ConfigError

from ..conftest import multirun


def _spec(*overrides: str):
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return preflight(cfg, "/nonexistent", list(overrides))


@pytest.fixture
def perturbed(tp_run, tmp_path):
    """A tiny SWA snapshot whose x_out rank 1 first request is off by 1 (its sha256 dropped)."""
    out = tmp_path / "snap"
    assert tp_run(layer="swa", tp=2, model="tiny", save_data=str(out), golden_cache=None).passed
    x = torch.load(out / "out" / "x_out.pt", weights_only=True)
    x[1, :8] += 1.0
    torch.save(x, out / "out" / "x_out.pt")
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["sha256"]["out/x_out.pt"]
    (out / "manifest.json").write_text(json.dumps(snapshot.sealed(manifest)))
    return out


def test_a_diagnostic_check_reports_its_failure_and_never_fails_the_run(tp_run, perturbed):
    failing = tp_run(golden_data=str(perturbed))
    assert failing.exit_code == 1, failing
    # A diagnostic reference check leaves the integrity checks on: an off-by-1 x_out still fails
    # by its cap; with them off the run reproduces the reference's verdict alone.
    capped = tp_run(golden_data=str(perturbed), overrides=["tolerance.x_out.diagnostic=true"])
    assert capped.exit_code == 1 and "reference verdict: PASS, integrity: FAIL (x_out cap" in capped.report, capped
    # The verdict line names the check that decided, not the diagnostic one that was not counted.
    assert ("VERDICT: FAIL by integrity (x_out cap); reference PASS; loosened: x_out diagnostic (FAIL, not counted) ("
            in capped.report), capped
    run = tp_run(golden_data=str(perturbed), overrides=["tolerance.x_out.diagnostic=true", "integrity=false"])
    assert run.exit_code == 0 and run.result["passed"], run
    x_out = run.verdict("x_out")
    assert x_out["diagnostic"] and not x_out["passed"] and x_out["kind"] == "budget+cap"
    assert x_out["figures"]["n_bad"] == failing.verdict("x_out")["figures"]["n_bad"] == 8192
    assert x_out["where"] and "ratio_reldiff fail: error_count=8192/131072" in x_out["detail"]
    assert not run.verdict("kv_cache")["diagnostic"]
    assert run.result["tolerance"]["diagnostic"] == ["x_out"]
    assert "x_out     all   FAIL (diagnostic)  8192/131072" in run.report
    assert "x_out FAIL, diagnostic: never fails the run (ratio_reldiff(" in run.report
    assert "where: x_out: 8192 bad points per rank and token block" in run.report
    assert "VERDICT: PASS; loosened: x_out diagnostic (FAIL, not counted), integrity=false (" in run.report


def test_a_parameter_override_is_the_comparator_and_is_marked(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=["tolerance.x_out.diff_thd=4e-3",
                                                              "tolerance.kv_cache.max_error_ratio=0"])
    assert run.passed, run
    x_out = run.verdict("x_out")
    assert x_out["label"].startswith("ratio_reldiff(diff_thd=0.004, pct_thd=0.008, max_diff_hd=1,")
    assert x_out["overridden"] == {"diff_thd": {"default": 0.003, "value": 0.004}}
    assert run.verdict("kv_cache")["overridden"] == {"max_error_ratio": {"default": 0.005, "value": 0}}
    assert run.result["tolerance"]["overridden"]["x_out"] == x_out["overridden"]
    assert "[set: diff_thd 0.003->0.004]" in run.report
    assert "tolerance: kv_cache max_error_ratio=0 (default 0.005); x_out diff_thd=0.004 (default 0.003)" in run.report


def test_the_reference_simulator_profile_relaxes_hca_at_p_above_1_and_makes_csa_x_out_diagnostic():
    hca = _spec("tolerance=reference_sim", "layer=hca", "model=tiny", "tp=2").tolerances
    assert hca.profile == "reference_sim"
    assert hca.params == {"x_out": {"diff_thd": 4e-3, "pct_thd": 0.008, "max_diff_hd": 2}} and not hca.diagnostic
    assert _spec("tolerance=reference_sim", "layer=hca", "model=tiny", "tp=1").tolerances.params == {}
    csa = _spec("tolerance=reference_sim", "layer=csa", "model=tiny", "tp=2").tolerances
    assert csa.diagnostic == {"x_out"} and csa.params == {}
    swa = _spec("tolerance=reference_sim", "layer=swa", "model=tiny", "tp=2").tolerances
    assert swa.params == {} and not swa.diagnostic
    # Never the default; the reference's own verdict profile keeps every threshold.
    for profile in ([], ["tolerance=reference"]):
        t = _spec(*profile, "layer=hca", "model=tiny", "tp=2").tolerances
        assert t.params == {} and not t.diagnostic


def test_an_explicit_override_wins_over_a_profile_entry():
    t = _spec("tolerance=reference_sim", "tolerance.x_out.diff_thd=5e-3", "layer=hca", "model=tiny", "tp=2").tolerances
    assert t.params["x_out"] == {"diff_thd": 5e-3, "pct_thd": 0.008, "max_diff_hd": 2}


def test_an_entry_for_a_tensor_this_run_does_not_compare_is_reported_not_applied():
    t = _spec("tolerance.idx_kv_cache.atol=2", "layer=swa", "model=tiny", "tp=2").tolerances
    assert t.params == {} and t.not_applied == ("idx_kv_cache",)


def test_a_profile_file_of_ones_own_may_set_any_top_level_key(tmp_path):
    (tmp_path / "tolerance").mkdir()
    (tmp_path / "tolerance" / "mine.yaml").write_text(
        "# @package _global_\nseed: 7\ntolerance:\n  profile: mine\n  x_out: {pct_thd: 0.01}\n")
    spec = _spec(f"hydra.searchpath=[file://{tmp_path}]", "tolerance=mine", "model=tiny", "tp=2")
    assert spec.case.seed == 7 and spec.tolerances.profile == "mine"
    assert spec.tolerances.params == {"x_out": {"pct_thd": 0.01}}


@pytest.mark.parametrize(
    "override, message",
    [
        ("tolerance.x_ot.diff_thd=4e-3", "tolerance.x_ot: no layer or scope compares a tensor named 'x_ot'; valid: "
                                         "attention_local_groups, cmp_kv, compress_state, idx_kv_cache,"),
        ("tolerance.x_out.dif_thd=4e-3", "tolerance.x_out.dif_thd: x_out has no parameter 'dif_thd'; valid: "
                                         "diagnostic, diff_thd, max_diff_hd, pct_thd"),
        ("tolerance.hca.idx_kv_cache.atol=1", "tolerance.hca.idx_kv_cache: layer hca compares no tensor named "
                                              "'idx_kv_cache'; valid: attention_local_groups, cmp_kv,"),
        ("tolerance.kv_cache.diff_thd=1", "tolerance.kv_cache.diff_thd: kv_cache has no parameter 'diff_thd'; "
                                          "valid: atol, diagnostic, max_error_ratio, rtol"),
        ("tolerance.x_out.diff_thd=abc", "tolerance.x_out.diff_thd='abc' must be a number >= 0"),
        ("tolerance.x_out.diff_thd=-1", "tolerance.x_out.diff_thd=-1 must be a number >= 0"),
        ("tolerance.x_out.diagnostic=1", "tolerance.x_out.diagnostic=1 must be true or false"),
        ("tolerance.x_out.pct_thd=2", "tolerance of x_out: pct_thd must be in [0, 1], got 2"),
    ],
)
def test_bad_tolerance_names_and_values_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        _spec(override, "model=tiny", "tp=2")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_parameter_this_runs_check_lacks_is_refused():
    with pytest.raises(ConfigError, match="o_local is judged by ExactCheck in swa scope=collectives, which has "
                                          "no 'atol'; valid: diagnostic"):
        _spec("tolerance.o_local.atol=1e-3", "scope=collectives", "model=tiny", "tp=2")


def test_a_sweep_over_profiles_shows_each_jobs_effective_comparators(tmp_path):
    p, summary, junit = multirun(tmp_path, "layer=hca", "model=tiny", "tp=2", "tolerance=default,reference_sim")
    assert p.returncode == 0, p.stdout + p.stderr
    default, sim = summary["jobs"]
    assert (default["tolerance_profile"], sim["tolerance_profile"]) == ("default", "reference_sim")
    assert [c["tensor"] for c in sim["checks"]] == ["compress_state", "kv_cache", "cmp_kv", "x_out"]
    x_default, x_sim = default["checks"][-1], sim["checks"][-1]
    assert x_default["comparator"].startswith("ratio_reldiff(diff_thd=0.003, pct_thd=0.008, max_diff_hd=1,")
    assert x_default["overridden"] == {}
    assert x_sim["comparator"].startswith("ratio_reldiff(diff_thd=0.004, pct_thd=0.008, max_diff_hd=2,")
    assert x_sim["overridden"] == {"diff_thd": {"default": 0.003, "value": 0.004},
                                   "max_diff_hd": {"default": 1.0, "value": 2}}
    cases = junit.find("testsuite").findall("testcase")
    props = {prop.get("name"): prop.get("value") for prop in cases[1].find("properties")}
    assert props["tolerance_profile"] == "reference_sim"
    assert props["check.x_out"].startswith("PASS ratio_reldiff(diff_thd=0.004,")
    assert props["check.x_out"].endswith("[set: diff_thd 0.003->0.004, max_diff_hd 1->2]")
