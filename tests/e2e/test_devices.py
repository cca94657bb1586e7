"""Backend/device selection and env handling (no accelerator needed), exact int8 GEMMs, torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from launcher.run import devices
from launcher.run.launch import is_casualty
from layers.contract.config import ConfigError
from layers.components.numerics import int8_matmul

from ..conftest import REPO


def test_auto_is_gloo_on_a_cpu_only_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    assert devices.resolve_backend("auto") == "gloo"


def test_auto_prefers_cuda_then_npu(monkeypatch):
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.resolve_backend("auto") == "nccl"
    # torch_npu present with an NPU: hccl wins over CUDA.
    fake = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8), raising=False)
    assert devices.resolve_backend("auto") == "hccl"
    assert devices.device_count("hccl") == 8


def test_explicit_backend_is_kept():
    assert devices.resolve_backend("gloo") == "gloo"
    assert devices.resolve_backend("nccl") == "nccl"


def test_more_ranks_than_visible_devices_fails_early(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"2 ranks per node need 2 cuda devices but 1 are visible \(CUDA_VISIBLE_DEVICES=3\)"):
        devices.check_devices("nccl", 2)
    devices.check_devices("nccl", 1)
    devices.check_devices("gloo", 64)  # the CPU has no device limit


def test_hccl_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    with pytest.raises(ConfigError, match=r"backend=hccl needs torch_npu"):
        devices.device_count("hccl")


@pytest.mark.parametrize("timeout_s, connect, exec_", [
    (20, "120", "68"),  # CANN's floor for the connect timeout; one 68 s step
    (300, "300", "340"),  # exec rounded up to the next multiple of 68 s, never shorter than timeout_s
    (9000, "7200", "9044"),  # CANN's ceiling for the connect timeout
])
def test_hccl_timeouts_follow_the_config_within_canns_ranges(timeout_s, connect, exec_):
    env = devices.collective_timeout_env("hccl", timeout_s, {})
    assert env == {"HCCL_CONNECT_TIMEOUT": connect, "HCCL_EXEC_TIMEOUT": exec_}
    assert devices.collective_timeout_env("gloo", timeout_s, {}) == {}


def test_hccl_timeouts_the_user_exported_are_kept():
    env = devices.collective_timeout_env("hccl", 20, {"HCCL_CONNECT_TIMEOUT": "600"})
    assert env == {"HCCL_EXEC_TIMEOUT": "68"}
    assert devices.collective_timeout_env("hccl", 20, {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "1360"}) == {}


def test_cpu_runs_never_import_torch_npu(tmp_path):
    code = (
        "import sys, launcher.cli, launcher.run.worker, launcher.run.devices as d; "
        "assert d.resolve_backend('gloo') == 'gloo'; d.setup_device('gloo', 0); "
        "assert 'torch_npu' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.mark.parametrize("k", [64, 1040, 1041, 4096])
def test_int8_gemm_is_exact_without_an_int32_gemm(k):
    g = torch.Generator().manual_seed(k)
    a = torch.randint(-127, 128, (33, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (k, 17), generator=g, dtype=torch.int8)
    a[0], b[:, 0] = 127, 127  # the largest sums: 127*127*k, above 2**24 from k = 1041 on
    a[1], b[:, 1] = -127, 127
    want = torch.matmul(a.to(torch.int32), b.to(torch.int32))  # the golden's exact int32 GEMM
    got = int8_matmul(a, b)
    assert got.dtype == torch.float32
    assert torch.equal(got, want.to(torch.float32))  # int32 -> fp32 rounds once, as the golden
    if k > 1040:
        assert int(want[0, 0]) > 2**24  # the fp32-accumulating shortcut would not be exact here


def test_external_torchrun_runs_the_same_worker(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    base = [torchrun, "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun-logs"),  # not /tmp
            "-m", "launcher.torchrun", "layer=swa", "tp=2", "model=tiny", "golden_cache=null"]
    env = dict(os.environ, PYTHONPATH=str(REPO), DSV4_OUTPUT_DIR=str(tmp_path / "out"))
    ok = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "VERDICT: PASS" in ok.stdout, ok.stdout + ok.stderr
    assert (tmp_path / "out" / "result.json").is_file()
    assert f"run folder: {tmp_path / 'out'}; page: {tmp_path / 'out' / 'report.html'}" in ok.stdout, ok.stdout
    bad = subprocess.run(base + ["impl=tests.defects.ReduceScatterWithoutSum"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "VERDICT: FAIL" in bad.stdout, bad.stdout + bad.stderr


def test_a_failing_rank_under_torchrun_reports_as_under_the_launcher(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text('{"status": "ok", "passed": true}')  # an earlier run's
    p = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun-logs"),
         "-m", "launcher.torchrun", "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
         "fault.kind=raise", "fault.rank=1", "timeout_s=30"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), DSV4_OUTPUT_DIR=str(out)),
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr  # torchrun's own status whenever a worker fails
    summary = p.stderr[p.stderr.index("Root Cause"):]
    assert "rank      : 1" in summary and "exitcode  : 2" in summary and "error_file: <N/A>" not in summary, summary
    assert "InjectedFault: injected fault: rank 1 raises" in summary  # the traceback, from the error file
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "error" and (result["error"]["rank"], result["error"]["phase"]) == (1, "layer"), result
    assert "VERDICT: ERROR" in p.stdout


def test_a_torchrun_worker_collects_garbage_again_once_its_imports_are_done(tmp_path):
    """`python -m launcher.torchrun` imports with the collector paused (`launcher.run.import_gc`)
    and runs the job with it on again and the imports' objects frozen."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    state = tmp_path / "state"
    p = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun-logs"),
         "-m", "launcher.torchrun", "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
         "impl=tests.defects.RecordsProcessState"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), DSV4_OUTPUT_DIR=str(tmp_path / "out"),
                               DSV4_TEST_PROCESS_STATE=str(state)),
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):
        enabled, frozen, _ = json.loads((tmp_path / f"state.rank{rank}").read_text())
        assert enabled and frozen > 10_000, (rank, enabled, frozen)


def test_under_torchrun_the_failing_rank_ends_with_its_own_status_however_slow_its_exit(tmp_path):
    """Rank 1 fails and is slow to exit after its connections closed: rank 0, whose collective
    broke, must not exit first (torchrun would then stop rank 1 and show its status as -15)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun-logs"),
         "-m", "launcher.torchrun", "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
         "impl=tests.defects.SlowToExitOnRank1", "timeout_s=30"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO), DSV4_OUTPUT_DIR=str(tmp_path / "out")),
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    summary = p.stderr[p.stderr.index("Root Cause"):]
    assert "rank      : 1" in summary and "exitcode  : 2" in summary, summary
    assert "rank 1's own error" in summary


@pytest.mark.parametrize("message", [
    "RuntimeError: [Rank 0] Timed out in allreduce after 20000 ms",  # gloo
    "EI0002: The wait execution of the Notify register times out. Reason: ...",  # HCCL notify wait
    "EI0006: Getting socket times out. Reason: 1. The remote does not initiate a connect request.",
    "HCCL function error: HcclAllReduce(...), error code is HCCL_E_TIMEOUT",
])
def test_a_peers_timeout_is_a_casualty_in_every_backends_wording(message):
    assert is_casualty(message)


def test_an_own_error_is_not_a_casualty():
    assert not is_casualty("RuntimeError: EI0003: invalid argument for the collective")
