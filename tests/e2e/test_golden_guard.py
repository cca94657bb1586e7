"""An implementation that replaces a function the golden also runs (a monkey-patch, as kernel
libraries make on import) is refused, wherever it patches (module import, constructor, call),
and its patch reaches neither the golden cache nor a later job of a sweep's warm ranks.

The patch (`tests.defects.fast_rms_norm`) makes the attention RMSNorm 5 % off: a golden computed
with it agrees with the default implementation run with it, so a poisoned golden would PASS the
defect and FAIL every correct run that reads it from the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, multirun, run_cli

from .. import defects

SWA = dict(layer="swa", tp=2, model="tiny")
SWA_ARGS = ["layer=swa", "tp=2", "model=tiny"]
PATCH = "layers.components.qkv.rms_norm was replaced by tests.defects.norm_patches.fast_rms_norm"
# Patches on import: only ever named as the impl of a run in processes of its own, never imported here.
ON_IMPORT = "tests.kernel_patch.FastNormTP"


def _result(out) -> dict:
    return json.loads((out / "out" / "result.json").read_text())


def _golden_entries(cache) -> list:
    return sorted(p.name for p in cache.glob("*.pt") if "-inputs-" not in p.name)


@pytest.mark.parametrize("start_method, stage", [("forkserver", "layer"), ("fork", "fixture")])
def test_an_impl_that_patches_on_import_is_refused_and_leaves_the_cache_correct(tmp_path, start_method, stage):
    # forkserver: the ranks import the impl after their golden. fork: the launcher imported it (its
    # preflight) before it forked the ranks, which find the patch before their golden.
    cache, refused, correct = tmp_path / "cache", tmp_path / "refused", tmp_path / "correct"
    refused.mkdir(), correct.mkdir()
    p = run_cli([*SWA_ARGS, f"golden_cache={cache}", f"impl._target_={ON_IMPORT}", f"start_method={start_method}"],
                refused)
    assert p.returncode == 2, p.stdout + p.stderr
    error = _result(refused)["error"]
    assert error["phase"] == stage, error
    assert "ImplContractError" in error["message"] and PATCH in error["message"], error
    if stage == "fixture":  # refused before any golden: nothing written
        assert _golden_entries(cache) == []
    # The correct implementation passes on the same cache, reading whatever the refused run left.
    q = run_cli([*SWA_ARGS, f"golden_cache={cache}"], correct)
    assert q.returncode == 0, q.stdout + q.stderr
    assert _result(correct)["golden_cache_hits"] == ([0, 1] if stage == "layer" else [])


def test_under_torchrun_a_patch_on_import_is_refused_before_any_golden(tmp_path):
    # The worker's preflight imports the implementation in the rank's own process.
    cache, out = tmp_path / "cache", tmp_path / "out"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun-logs"),
         "-m", "launcher.torchrun", *SWA_ARGS, f"golden_cache={cache}", f"impl._target_={ON_IMPORT}"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), DSV4_OUTPUT_DIR=str(out)),
        capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stdout + p.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "error" and result["error"]["phase"] == "fixture", result
    assert "changed before this job's golden" in result["error"]["message"], result
    assert PATCH in result["error"]["message"], result
    assert _golden_entries(cache) == []


@pytest.mark.parametrize("impl, when", [
    (defects.PatchesNormInConstructor, "on import or construction of the implementation"),
    (defects.PatchesNormDuringCall, "while the implementation ran"),
])
def test_a_patch_in_the_constructor_or_the_call_is_refused(tp_run, tmp_path, impl, when):
    cache = str(tmp_path / "cache")
    run = tp_run(**SWA, golden_cache=cache, impl=impl)
    assert run.exit_code == 2, run
    assert run.result["error"]["phase"] == "layer", run
    assert f"functions the golden and the judges run changed {when}: {PATCH}" in run.report, run
    assert tp_run(**SWA, golden_cache=cache).passed  # the cache holds the true golden


def _jobs(tmp_path, n: int) -> list[dict]:
    return [json.loads((tmp_path / "sweep" / str(j) / "result.json").read_text()) for j in range(n)]


def test_a_sweep_job_after_a_patching_one_is_not_poisoned(tmp_path):
    cache = tmp_path / "cache"
    p, _, _ = multirun(tmp_path, *SWA_ARGS, f"golden_cache={cache}", f"impl._target_={ON_IMPORT},layers.tp.TorchTP")
    assert p.returncode == 2, p.stdout + p.stderr
    patched, correct = _jobs(tmp_path, 2)
    assert patched["status"] == "error" and PATCH in patched["error"]["message"], patched
    # On fresh ranks, and the golden it read from the cache (the refused job's) is the true one.
    assert correct["passed"] and not correct["rank_processes"]["warm"], correct
    assert correct["golden_cache_hits"] == [0, 1], correct


def test_a_patch_made_after_a_jobs_checks_ends_its_warm_ranks(tmp_path):
    # The first job's implementation patches when the harness drops it, after every check of its
    # job (its verdict stands); its ranks must not serve the next job.
    cache = tmp_path / "cache"
    p, _, _ = multirun(tmp_path, *SWA_ARGS, f"golden_cache={cache}",
                       "impl._target_=tests.defects.PatchesNormWhenDropped,layers.tp.TorchTP")
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = _jobs(tmp_path, 2)
    assert first["passed"] and second["passed"], (first, second)
    assert second["rank_processes"] == {"jobs_run": 1, "warm": False}, second
