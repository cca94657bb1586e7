"""Injected faults end the run in bounded time, leave no process behind and name rank and phase."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ..conftest import REPO


def _processes_of(run_dir: str) -> list[int]:
    """Live processes started for the runs under `run_dir` (the agent tags each with its run id)."""
    run_ids = {os.path.basename(p).rsplit("_", 1)[0] for p in glob.glob(os.path.join(run_dir, "**", "logs", "*"), recursive=True)}
    pids = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            env = open(environ, "rb").read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"TORCHELASTIC_RUN_ID=") and e.split(b"=", 1)[1].decode() in run_ids for e in env):
            pids.append(int(environ.split("/")[2]))
    return pids


def _no_orphans(run_dir: str) -> None:
    deadline = time.monotonic() + 10  # the agent reaps its workers right after the failure
    while _processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(run_dir) == []


@pytest.mark.parametrize(
    "kind, phase, message",
    [
        ("raise", "fixture", "InjectedFault: injected fault: rank 1 raises at the start of phase 'fixture'"),
        ("raise", "gather", "InjectedFault"),
        # The agent may see a peer's broken collective before rank 1's exit status: either
        # way rank 1 and the phase are named.
        ("exit", "layer", "in phase 'layer' without"),
        ("hang", "layer", "rank 1 stopped in phase 'layer' without an error report"),
        ("hang", "fixture", "rank 1 stopped in phase 'fixture' without an error report"),
    ],
)
@pytest.mark.timeout(120)
def test_process_fault_is_reported_with_rank_and_phase(tp_run, tmp_path, kind, phase, message):
    t0 = time.monotonic()
    run = tp_run(layer="swa", tp=2, model="tiny", timeout_s=5, overrides=[f"fault.kind={kind}", "fault.rank=1", f"fault.phase={phase}"])
    assert time.monotonic() - t0 < 60
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (1, phase), run
    assert message in err["message"], run
    assert err["log_dir"] and err["log_dir"].endswith(os.path.join("attempt_0", "1")), run
    assert os.path.isfile(os.path.join(err["log_dir"], "stderr.log"))
    # The traceback box holds what went wrong, not the rank's INFO records of its phases.
    assert " INFO phase " not in err["traceback"], err["traceback"]
    _no_orphans(str(tmp_path))


def test_a_golden_that_fails_on_one_rank_stops_every_rank_before_the_implementation(tp_run):
    run = tp_run(layer="swa", tp=4, model="tiny", overrides=["fault.kind=raise", "fault.rank=2", "fault.phase=golden"])
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (2, "golden"), run
    attempt = os.path.dirname(err["log_dir"])
    for rank in (0, 1, 3):  # each names the rank whose golden failed, and stops
        with open(os.path.join(attempt, str(rank), "stderr.log")) as f:
            assert "the golden failed on rank(s) [2]; no rank runs the implementation" in f.read(), rank
    events = [json.loads(line) for path in glob.glob(os.path.join(run.output_dir, "progress", "rank*.jsonl"))
              for line in open(path)]
    assert len({e["rank"] for e in events}) == 4 and not any(e["phase"] == "layer" for e in events)


@pytest.mark.timeout(120)
def test_hang_without_any_collective_ends_at_the_rank_deadline(tp_run, tmp_path):
    run = tp_run(layer="swa", tp=1, model="tiny", timeout_s=3, overrides=["fault.kind=hang", "fault.rank=0", "fault.phase=golden"])
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (0, "golden")
    assert "outlived its deadline" in err["message"] and "at_phase_start" in err["traceback"], run
    _no_orphans(str(tmp_path))


def test_nan_gives_fail_with_counts(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=["fault.kind=nan", "fault.rank=1"])
    assert run.exit_code == 1, run
    v = run.verdict("x_out")
    assert not v["passed"] and v["figures"]["nan_actual"] == 8 * 4 * 256
    assert [r["nan_actual"] for r in v["per_rank"]] == [0, 8 * 4 * 256]
    assert "NaN=8192" in run.report


def test_corrupt_gives_fail_naming_tensor_and_rank(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=["fault.kind=corrupt", "fault.rank=0"])
    assert run.exit_code == 1, run
    v = run.verdict("x_out")
    assert not v["passed"] and run.verdict("kv_cache")["passed"]
    assert [r["rank"] for r in v["per_rank"] if r["n_bad"]] == [0]


@pytest.mark.parametrize("keys, tensor", [
    ({"layer": "swa", "tp": 2, "scope": "output"}, "o_partial"),
    ({"layer": "moe", "ep": 2}, "x_next"),
])
def test_an_output_fault_hits_a_scopes_and_the_moe_layers_output(tp_run, keys, tensor):
    run = tp_run(model="tiny", overrides=["fault.kind=nan", "fault.rank=1"], **keys)
    assert run.exit_code == 1, run
    assert not run.verdict(tensor)["passed"], run


@pytest.mark.parametrize("bad, message", [
    (["fault.kind=melt"], "fault.kind='melt' must be one of"),
    (["fault.kind=raise", "fault.rank=2"], "fault.rank=2 must be in [0, 2)"),
    (["fault.kind=nan", "fault.phase=fixture"], "needs fault.phase=layer"),
    (["fault.kind=raise", "fault.rank=5"], "fault.rank=5 must be in [0, 2)"),
    (["fault.kind=raise", "fault.phase=bogus"], "fault.phase='bogus' must be one of"),
    (["fault.phase=bogus"], "fault.phase='bogus' must be one of"),
    (["fault.rank=5"], "fault.rank=5 must be in [0, 2)"),
    (["fault.kind=raise", "fault.phase=save"], "never runs without save_data"),
    (["fault.kind=raise", "fault.stage=golden"], "fault.stage is now fault.phase; write fault.phase=golden"),
])
def test_bad_fault_config_is_refused(tp_run, bad, message):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=bad)
    assert run.exit_code == 2 and message in run.report


@pytest.mark.parametrize("phase, rank, extra", [("compare", 0, []), ("compare", 1, []), ("save", 0, ["save_data=SNAP"])])
def test_faults_in_the_conditional_phases_fire(tp_run, tmp_path, phase, rank, extra):
    overrides = [o.replace("SNAP", str(tmp_path / "snap")) for o in extra]
    run = tp_run(layer="swa", tp=2, model="tiny",
                 overrides=[*overrides, "fault.kind=raise", f"fault.rank={rank}", f"fault.phase={phase}"])
    assert run.exit_code == 2, run
    assert run.result["error"]["rank"] == rank and run.result["error"]["phase"] == phase


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.timeout(120)
def test_signal_to_the_launcher_stops_every_rank(tmp_path, sig):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "layer=swa", "tp=2", "model=tiny", "timeout_s=60",
         "fault.kind=hang", "fault.rank=1", f"hydra.run.dir={out}"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    progress = out / "progress" / "rank1.jsonl"
    deadline = time.monotonic() + 60
    while not (progress.exists() and '"layer", "event": "start"' in progress.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert progress.exists(), "the ranks never started"
    t0 = time.monotonic()
    proc.send_signal(sig)
    text, _ = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 128 + sig, text
    assert f"interrupted by {signal.Signals(sig).name}: every rank was stopped" in text
    _no_orphans(str(tmp_path))
    assert not list(tmp_path.rglob("*.tmp"))  # no half-written files left behind
