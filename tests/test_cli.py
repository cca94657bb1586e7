"""The command line: bad input gets one clear line and exit status 2 before any rank is started;
print-only flags launch nothing; a run leaves nothing behind in the temp dir."""

from __future__ import annotations

import os
import tempfile

import pytest
from hydra import compose, initialize_config_module

from launcher.report.result import EXIT_ERROR
from launcher.run.preflight import preflight
from layers.contract.config import ConfigError

from .conftest import run_cli


def _preflight(*overrides: str):
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return preflight(cfg, "/nonexistent")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tp=3", "model=tiny"], "tp=3 must divide o_groups=8"),
        (["tp=16", "model=tiny"], "tp=16 must divide o_groups=8"),
        (["tp=0", "model=tiny"], "tp=0 must be >= 1"),
        (["tp=2", "model=tiny", "local_t=12"], "local_t=12 must be a multiple of 8"),
        (["tp=2", "model=tiny", "local_t=72"], "in [8, 64]"),
        (["tp=2", "model=tiny", "local_t=0"], "local_t=0"),
        (["tp=2", "model=tiny", "start_pos=-1"], "must be non-negative"),
        (["tp=2", "model=tiny", "start_pos=1048570"], "context ceiling 1048576"),
        (["tp=2", "model=tiny", "start_pos=[1,2,3]"], "start_pos has 3 entries"),
        (["tp=2", "model=tiny", "start_pos=abc"], "must be an integer"),
        (["tp=2", "model=tiny", "backend=nccl"], "need 2 cuda devices but 0 are visible"),
        (["tp=2", "model=tiny", "backend=foo"], "backend='foo' must be one of"),
        (["tp=2", "model=tiny", "impl._target_=nowhere.Impl"], "impl._target_='nowhere.Impl' cannot be imported"),
        (["tp=2", "model=tiny", "timeout_s=0"], "timeout_s=0"),
        (["tp=2", "model=tiny", "model.num_attention_heads=12"], "num_attention_heads must be a multiple of o_groups"),
        # Fields whose nonsense values give a NaN golden or a crash in it.
        (["model=tiny", "model.rms_norm_eps=-1"], "rms_norm_eps=-1.0 must be > 0"),
        (["model=tiny", "model.rms_norm_eps=nan"], "rms_norm_eps=nan must be finite"),
        (["model=tiny", "model.hc_eps=0"], "hc_eps=0.0 must be > 0"),
        (["model=tiny", "model.hc_sinkhorn_iters=0"], "hc_sinkhorn_iters=0 must be >= 1"),
        (["model=tiny", "model.rope_theta=0"], "rope_theta=0.0 must be > 1"),
        (["model=tiny", "model.compress_rope_theta=1"], "compress_rope_theta=1.0 must be > 1"),
        (["model=tiny", "model.rope_factor=0"], "rope_factor=0.0 must be >= 1"),
        (["model=tiny", "model.beta_fast=0"], "must satisfy 0 < beta_slow <= beta_fast"),
        (["model=tiny", "model.original_max_position_embeddings=-5"], "original_max_position_embeddings=-5 must be >= 0"),
    ],
)
def test_invalid_config_is_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError, match=None) as e:
        _preflight(*overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["layer=swq"], "Could not find 'layer/swq'"),
        (["tpp=2"], "Could not override 'tpp'"),
        (["model.hidden_size=abc"], "could not be converted to Integer"),
        (["model=huge"], "Could not find 'model/huge'"),
        (["tp=3", "model=tiny"], "tp=3 must divide o_groups=8"),
        (["model=tiny", "model.rms_norm_eps=-1"], "rms_norm_eps=-1.0 must be > 0"),
    ],
)
def test_cli_prints_one_error_line_and_exits_2(tmp_path, args, message):
    p = run_cli(args, tmp_path, timeout=120)
    assert p.returncode == EXIT_ERROR, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert message in lines[0]
    assert not (tmp_path / "out" / "logs").exists()  # nothing was launched


@pytest.mark.parametrize(
    "argv, starts",
    [
        (["layer=csa", "tp=8"], True),
        (["-m", "tp=1,2"], True),
        (["start_method=forkserver"], True),
        (["start_method=spawn"], False),
        (["--help"], False),
        (["--cfg", "job"], False),
        (["--cfg=job"], False),
        (["-c", "job"], False),
        (["--info"], False),
    ],
)
def test_forkserver_is_started_early_only_for_a_run_that_uses_it(argv, starts):
    from launcher.__main__ import _launches_by_forkserver

    assert _launches_by_forkserver(argv) is starts


def test_print_only_flags_print_and_exit_0(tmp_path):
    p = run_cli(["--cfg", "job", "layer=csa", "tp=4"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "\ntp: 4\n" in p.stdout and "layer:\n  name: csa\n" in p.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("impl, code", [("layers.tp.TorchTP", 0), ("tests.defects.ReduceScatterWithoutSum", 1)])
def test_a_run_leaves_nothing_in_the_temp_dir(tmp_path, impl, code):
    # The launcher skips the interpreter's teardown at exit; the forkserver's socket folder
    # (multiprocessing's pymp-*) must still be removed.
    # A short folder of its own: the forkserver's socket path must fit AF_UNIX's 108 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="t") as tmp:
        p = run_cli(["layer=swa", "tp=2", "model=tiny", "golden_cache=null", f"impl={impl}"], tmp_path,
                    timeout=120, env={"TMPDIR": tmp})
        assert p.returncode == code, p.stdout + p.stderr
        assert sorted(os.listdir(tmp)) == []


def test_a_temp_dir_too_long_for_a_unix_socket_still_runs(tmp_path):
    tmp = tmp_path / ("t" * (120 - len(str(tmp_path))))
    tmp.mkdir()
    p = run_cli(["layer=swa", "tp=2", "model=tiny", "golden_cache=null"], tmp_path, timeout=120,
                env={"TMPDIR": str(tmp)})
    assert p.returncode == 0, p.stdout + p.stderr
