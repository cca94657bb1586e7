"""A sweep's jobs on warm rank processes (`launcher.run.rank_group`): the same verdicts and
figures as fresh processes, nothing of one job reaching the next."""

from __future__ import annotations

import json

from tests.conftest import multirun

TINY = ["model=tiny", "tp=2", "golden_cache=null"]


def _jobs(tmp_path, n: int) -> list[dict]:
    return [json.loads((tmp_path / "sweep" / str(j) / "result.json").read_text()) for j in range(n)]


def _figures(result: dict) -> dict:
    """What a verdict says, without the times and memory that vary run to run."""
    return {"passed": result["passed"], "verdicts": result["verdicts"], "integrity": result["integrity"],
            "case": result["case"]}


def test_warm_sweep_gives_the_figures_of_fresh_processes(tmp_path):
    # Each layer twice: the second job also reuses the weights the first drew (layers.fixtures.kept).
    sweep = ["layer=swa,csa,hca", "local_t=16,64", *TINY]
    warm_dir, cold_dir = tmp_path / "warm", tmp_path / "cold"
    warm_dir.mkdir(), cold_dir.mkdir()
    p, summary, _ = multirun(warm_dir, *sweep)
    assert p.returncode == 0, p.stdout + p.stderr
    q, _, _ = multirun(cold_dir, *sweep, "warm_ranks=false")
    assert q.returncode == 0, q.stdout + q.stderr
    warm, cold = _jobs(warm_dir, 6), _jobs(cold_dir, 6)
    # Every job after the first ran on the processes the jobs before it left.
    assert [r["rank_processes"]["jobs_run"] for r in warm] == [1, 2, 3, 4, 5, 6]
    assert [r["rank_processes"]["warm"] for r in cold] == [False] * 6
    for w, c in zip(warm, cold):
        assert _figures(w) == _figures(c)


def test_a_failing_job_leaves_no_warm_rank_to_the_next(tmp_path):
    p, summary, _ = multirun(tmp_path, "layer=hca", "impl._target_=layers.tp.TorchTP,tests.defects.HcaMissedCommit",
                             "seed=7,8", *TINY)
    assert p.returncode == 1, p.stdout + p.stderr
    # Jobs in sweep order: (TorchTP, seed 7), (TorchTP, 8), (defect, 7), (defect, 8); Hydra
    # varies the last key fastest.
    jobs = _jobs(tmp_path, 4)
    assert [r["passed"] for r in jobs] == [True, True, False, False]
    assert [r["rank_processes"]["jobs_run"] for r in jobs] == [1, 2, 3, 1]  # fresh after the FAIL


def test_a_defect_between_good_jobs_does_not_reach_them(tmp_path):
    good = "layers.tp.TorchTP"
    p, _, _ = multirun(tmp_path, "layer=swa", f"impl._target_={good},tests.defects.PerturbRankTokens,{good}", *TINY)
    assert p.returncode == 1, p.stdout + p.stderr
    before, defect, after = _jobs(tmp_path, 3)
    assert (before["passed"], defect["passed"], after["passed"]) == (True, False, True)
    assert defect["rank_processes"]["warm"] and not after["rank_processes"]["warm"]
    assert _figures(after) == _figures(before)


def test_process_state_a_job_changed_is_put_back_before_the_next(tmp_path):
    p, _, _ = multirun(tmp_path, "layer=swa",
                       "impl._target_=tests.defects.ChangesProcessState,tests.defects.ExpectsFreshProcessState", *TINY)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = _jobs(tmp_path, 2)
    assert first["passed"] and second["passed"], second.get("error")
    assert second["rank_processes"]["warm"]
