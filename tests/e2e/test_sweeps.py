"""Sweeps: real multiruns of the CLI, their summary, JUnit file and exit status; the named sweeps;
the progress display with and without a terminal."""

from __future__ import annotations

import datetime
import io
import json
import os
import re

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.report import progress
from launcher.report.result import EXIT_ERROR, EXIT_FAIL, EXIT_PASS, SCHEMA_VERSION
from launcher.report.sweep_summary import junit_tree
from launcher.run import devices
from launcher.run.preflight import preflight
from launcher.store import snapshot
from launcher.sweep import planned

from ..conftest import multirun

# Anything but newline (and tab) is a control character in a log: carriage returns, ANSI escapes.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f]")


def test_tiny_multirun_summary_and_junit(tmp_path):
    p, summary, junit = multirun(tmp_path, "layer=swa,hca", "model=tiny", "tp=1,2")
    assert p.returncode == EXIT_PASS, p.stdout + p.stderr
    jobs = summary["jobs"]
    assert [(j["job"], j["layer"], j["tp"], j["local_t"]) for j in jobs] == [
        (0, "swa", 1, 128), (1, "swa", 2, 64), (2, "hca", 1, 128), (3, "hca", 2, 64)]  # capacity 16*8/tp
    assert all(j["verdict"] == "PASS" and j["model"] == "tiny" and j["start_pos"] is None for j in jobs)
    assert all(j["tensor"] == "x_out" and j["max_abs_diff"] is not None and j["wall_s"] > 0 for j in jobs)
    assert (summary["n_jobs"], summary["passed"], summary["failed"], summary["errors"]) == (4, 4, 0, 0)
    for j in jobs:
        result = json.load(open(os.path.join(j["output_dir"], "result.json")))
        assert result["passed"] is True
        assert result["devices"] == [devices.cpu_model()] and result["threads_per_rank"] == max(1, 2 // j["tp"])
        assert os.path.isfile(os.path.join(j["output_dir"], "report.html"))
    assert os.path.isfile(os.path.join(summary["sweep_dir"], "report.html"))
    _assert_provenance(summary)
    _assert_provenance(result)
    suite = junit.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "0", "0")
    cases = suite.findall("testcase")
    assert [c.get("classname") for c in cases] == ["dsv4-tp-harness.swa.full"] * 2 + ["dsv4-tp-harness.hca.full"] * 2
    assert cases[1].get("name") == "model=tiny tp=2 local_t=64 seed=20260819"
    assert not any(c.find("failure") is not None or c.find("error") is not None for c in cases)
    table = p.stdout[p.stdout.index("job  layer"):].splitlines()
    assert table[1].split()[:8] == ["0", "swa", "full", "tiny", "1", "128", "canonical", "PASS"]
    assert table[4].split()[:8] == ["3", "hca", "full", "tiny", "2", "64", "canonical", "PASS"]
    assert "[4/4] PASS" in p.stderr and "[2/4] swa tiny tp=2 local_t=64: layer done on 2/2 ranks" in p.stderr


def _assert_provenance(record: dict) -> None:
    assert record["schema_version"] == SCHEMA_VERSION and record["tool_version"] == snapshot.tool_version()
    assert record["torch"] == torch.__version__ and record["host"]
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(record["created_utc"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(hours=1)


def _row(job: int, tp: int) -> dict:
    return {"job": job, "overrides": ["layer=swa", "model=tiny", f"tp={tp}", "impl=layers.tp.TorchTP"],
            "output_dir": f"out/{job}", "layer": "swa", "scope": "full", "model": "tiny", "tp": tp, "dp": 1,
            "local_t": 128 // tp, "start_pos": None, "seed": 1, "verdict": "PASS", "wall_s": 1.0}


def test_junit_names_each_test_by_its_case_whatever_its_place_in_the_sweep():
    def names(rows):
        return {r["tp"]: c.get("name") for r, c in zip(rows, junit_tree(rows).getroot().iter("testcase"))}

    forward, backward = names([_row(0, 1), _row(1, 2)]), names([_row(0, 2), _row(1, 1)])
    assert forward == backward
    assert forward[2] == "model=tiny tp=2 local_t=64 seed=1 impl=layers.tp.TorchTP"
    # The same case twice is still two testcases.
    assert [c.get("name") for c in junit_tree([_row(0, 1), _row(1, 1)]).getroot().iter("testcase")] == [
        forward[1], f"{forward[1]} (2)"]


def test_a_failing_and_a_crashing_job_do_not_stop_the_sweep(tmp_path):
    impls = "tests.defects.PerturbRankTokens,tests.defects.CrashOnRank1,layers.tp.TorchTP"
    p, summary, junit = multirun(tmp_path, "layer=swa", "model=tiny", "tp=2", f"impl._target_={impls}")
    assert p.returncode == EXIT_ERROR, p.stdout + p.stderr  # the worst job's status: a crash
    failed, crashed, passed = summary["jobs"]
    assert (failed["verdict"], crashed["verdict"], passed["verdict"]) == ("FAIL", "ERROR", "PASS")
    assert failed["tensor"] == "x_out" and failed["failed_tensors"] == ["x_out"] and failed["n_bad"] > 0
    assert "rank 1" in crashed["message"] and crashed["exit_code"] == EXIT_ERROR
    cases = junit.find("testsuite").findall("testcase")
    failure = cases[0].find("failure")
    assert failure.get("message").startswith("x_out FAIL (ratio_reldiff(")
    assert "ratio_reldiff fail: error_count=" in failure.text  # the comparator's own message
    assert cases[1].find("error") is not None and cases[2].find("failure") is None
    # Pipes, not a terminal: plain lines only.
    assert not CONTROL.search(p.stdout) and not CONTROL.search(p.stderr)


def test_fail_fast_skips_the_rest(tmp_path):
    p, summary, junit = multirun(tmp_path, "model=tiny", "tp=3,2", "fail_fast=true")
    assert p.returncode == EXIT_ERROR, p.stdout + p.stderr
    refused, skipped = summary["jobs"]
    assert refused["verdict"] == "ERROR" and "tp=3 must divide o_groups=8" in refused["message"]
    assert skipped["verdict"] == "SKIP" and skipped["tp"] == 2
    assert not os.path.exists(os.path.join(skipped["output_dir"], "logs"))  # nothing was launched
    _assert_provenance(json.load(open(os.path.join(refused["output_dir"], "result.json"))))
    assert junit.find("testsuite").findall("testcase")[1].find("skipped") is not None


def test_a_mismatch_alone_exits_1(tmp_path):
    p, summary, _ = multirun(tmp_path, "model=tiny", "tp=2", "impl._target_=tests.defects.PerturbRankTokens,layers.tp.TorchTP")
    assert p.returncode == EXIT_FAIL, p.stdout + p.stderr
    assert [j["verdict"] for j in summary["jobs"]] == ["FAIL", "PASS"]


def test_a_nan_job_row_agrees_with_its_detail(tmp_path):
    """x_out holds 8192 NaN: the comparator's n_bad counts finite points only (0); the row, the
    table and JUnit count the NaN points as the detail does."""
    p, summary, junit = multirun(tmp_path, "layer=swa", "model=tiny", "tp=2", "fault.kind=null,nan")
    assert p.returncode == EXIT_FAIL, p.stdout + p.stderr
    clean, nan = summary["jobs"]
    assert (clean["verdict"], clean["n_bad"], clean["numel"]) == ("PASS", 0, 2 * 64 * 4 * 256)
    assert (nan["verdict"], nan["tensor"], nan["n_bad"], nan["numel"]) == ("FAIL", "x_out", 8192, 2 * 64 * 4 * 256)
    assert "NaN=8192" in nan["details"][0]
    assert p.stdout[p.stdout.index("job  layer"):].splitlines()[2].split()[11] == "8192/131072"
    assert "NaN=8192" in junit.find("testsuite").findall("testcase")[1].find("failure").text


# -- the named sweeps, expanded as `python -m launcher.sweep list` lists them ---------------------


def _jobs(sweep: str) -> list[list[str]]:
    return planned([f"+sweep={sweep}"])


def _cases(jobs: list[list[str]]) -> list[tuple]:
    out = []
    with initialize_config_module(config_module="configs", version_base=None):
        for job in jobs:
            c = preflight(compose(config_name="config", overrides=job), "/nonexistent").case
            out.append((c.layer, c.model.name, c.tp, c.local_t, c.start_pos))
    return out


def test_smoke_is_every_layer_at_tiny_tp_1_and_8():
    cases = _cases(_jobs("smoke"))
    assert sorted((layer, m, t, lt) for layer, m, t, lt, _ in cases) == sorted(
        (layer, "tiny", t, 128 // t) for layer in ("swa", "csa", "hca") for t in (1, 8))


def test_full_is_every_layer_at_flash_over_tp_tokens_and_starts():
    cases = _cases(_jobs("full"))  # every job passes the preflight
    assert len(cases) == 48
    expected = set()
    for layer in ("swa", "csa", "hca"):
        for t in (1, 2, 4, 8):
            cap = 512 // t
            for local_t in (cap, cap if t == 1 else cap - 8):  # TP1 runs its capacity alone
                expected.add((layer, t, local_t, "canonical"))
                expected.add((layer, t, local_t, "mixed"))
    got = {(layer, t, lt, "canonical" if sp is None else "mixed") for layer, m, t, lt, sp in cases}
    assert got == expected and {m for _, m, *_ in cases} == {"flash"}
    for layer, _, t, local_t, sp in cases:
        if sp is not None:  # the group form: one start per request of the TP group, ranks differ
            b = local_t // 8
            assert len(sp) == t * b
            assert t == 1 or len({tuple(sp[r * b:(r + 1) * b]) for r in range(t)}) == t


def test_resolvers_follow_the_jobs_tp_and_model():
    def resolved(*overrides):
        with initialize_config_module(config_module="configs", version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        return cfg.local_t, cfg.start_pos

    assert resolved("model=tiny", "tp=2", "local_t=${capacity:}")[0] == 64
    assert resolved("model=tiny", "tp=2", "local_t=${capacity:1}")[0] == 56
    assert resolved("model=tiny", "tp=2", "+tokens=row_block_below")[0] == 56
    assert resolved("model=tiny", "tp=1", "+tokens=row_block_below")[0] == 128
    _, starts = resolved("model=tiny", "tp=2", "local_t=16", "+starts=mixed")
    assert list(starts) == [8192, 0, 2, 3]  # 2 ranks x 2 requests, in pattern order


# -- the progress display ------------------------------------------------------------------------


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _events(out_dir, rank: int, *events: tuple[str, str, float]) -> None:
    path = out_dir / "progress" / f"rank{rank}.jsonl"
    path.parent.mkdir(exist_ok=True)
    with open(path, "a") as f:
        for stage, event, t in events:
            f.write(json.dumps({"rank": rank, "phase": stage, "event": event, "t": t}) + "\n")


@pytest.mark.parametrize("tty", [False, True])
def test_stage_progress_plain_lines_or_one_status_line(tmp_path, tty):
    stream = _Stream(tty)
    watcher = progress.PhaseWatcher(str(tmp_path), 2, "swa tiny tp=2", display=progress.Display(stream), poll_s=60)
    _events(tmp_path, 0, ("fixture", "start", 1.0), ("fixture", "done", 1.5), ("golden", "start", 1.5))
    watcher.poll()
    _events(tmp_path, 1, ("fixture", "start", 1.1), ("fixture", "done", 1.7), ("golden", "start", 1.7),
            ("golden", "failed", 2.0))
    watcher.poll()
    watcher.poll()  # nothing new: nothing repeated
    text = stream.getvalue()
    lines = [ln for ln in re.split(r"[\r\n]", text) if ln.strip()]
    done = [ln for ln in lines if "fixture done on 2/2 ranks (0.70s)" in ln]
    failed = [ln for ln in lines if "rank 1 failed in phase golden" in ln]
    assert len(done) == 1 and len(failed) == 1
    if tty:
        assert "\r\x1b[2K" in text and "fixture 2/2  golden 0/2 FAILED" in text
    else:
        assert not CONTROL.search(text)
        assert text.splitlines() == ["swa tiny tp=2: fixture done on 2/2 ranks (0.70s)",
                                     "swa tiny tp=2: rank 1 failed in phase golden"]


def test_the_status_line_is_cut_to_the_terminals_width(monkeypatch):
    # A status line longer than the terminal wraps, and "\r" then rewrites only its last row:
    # the screen fills with stale status lines.
    monkeypatch.setenv("COLUMNS", "30")
    stream = _Stream(True)
    progress.Display(stream).status("[3/12] csa flash tp=8 local_t=64  fixture 8/8  golden 8/8  layer 3/8  41.2s")
    shown = stream.getvalue().replace("\r\x1b[2K", "").rstrip("\r")
    assert shown == "[3/12] csa flash tp=8 local_t"  # 29 columns: the cursor never reaches the last one


def test_compare_is_done_when_every_rank_judged(tmp_path):
    # Every rank judges its share of the checks: rank 0's compare alone is not the stage's end.
    stream = _Stream(False)
    watcher = progress.PhaseWatcher(str(tmp_path), 2, "x", display=progress.Display(stream), poll_s=60)
    _events(tmp_path, 0, ("compare", "start", 1.0), ("compare", "done", 1.25))
    watcher.poll()
    assert stream.getvalue() == ""
    _events(tmp_path, 1, ("compare", "start", 1.0), ("compare", "done", 1.5))
    watcher.poll()
    assert stream.getvalue() == "x: compare done on 2/2 ranks (0.50s)\n"
