"""The command line: bad input gets one clear line and exit status 2 before any rank is started;
print-only flags launch nothing; a run leaves nothing behind in the temp dir."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from launcher.report.result import EXIT_ERROR
from launcher.run.preflight import preflight
from layers.contract.config import ConfigError

from ..conftest import REPO, run_cli

# torch's compile cache folder in the temp dir (torch._inductor's default cache_dir).
TORCH_COMPILE_CACHE = f"torchinductor_{getpass.getuser()}"


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
        (["tp=2", "model=tiny", "timeout_s=nan"], "timeout_s=nan must be a finite number of seconds >= 1"),
        (["tp=2", "model=tiny", "timeout_s=inf"], "timeout_s=inf must be a finite number of seconds >= 1"),
        (["tp=2", "model=tiny", "timeout_s=1e-9"], "timeout_s=1e-09 must be a finite number of seconds >= 1"),
        (["tp=2", "model=tiny", "model.hidden_size=0"], "model.hidden_size=0 must be >= 1"),
        (["tp=2", "model=tiny", "model.block_size=0"], "model.block_size=0 must be >= 1"),
        (["tp=2", "model=tiny", "model.o_groups=-8"], "model.o_groups=-8 must be >= 1"),
        (["tp=2", "model=tiny", "model.kv_ori_block_num=0"], "model.kv_ori_block_num=0 must be >= 1"),
        (["tp=2", "model=tiny", "impl=tests.defects.takes_nothing"],
         "impl._target_='tests.defects.takes_nothing' is a function that cannot be called as (ctx, tensors)"),
        (["tp=2", "model=tiny", "impl=tests.defects.NotCallable"],
         "impl._target_='tests.defects.NotCallable' is a class whose instances cannot be called as impl(ctx, tensors)"),
        (["tp=2", "model=tiny", "impl=tests.defects.NOT_AN_IMPLEMENTATION"], "is a int, not a class or a function"),
        (["tp=2", "model=tiny", "impl._target_=tests.defects.PerturbRankTokens", "+impl.scale=2"],
         "the class cannot be built as PerturbRankTokens(scale=...)"),
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


def test_a_moe_runs_case_names_the_tokens_it_ran():
    # README: num_tokens null means all 128 tokens per rank; the header and result.json say 128.
    assert _preflight("layer=moe", "model=tiny").case_entry()["num_tokens"] == 128
    assert _preflight("layer=moe", "model=tiny", "num_tokens=37").case_entry()["num_tokens"] == 37


@pytest.mark.parametrize(
    "args, message",
    [
        (["layer=swq"], "Could not find 'layer/swq'"),
        (["tpp=2"], "tpp=2: 'tpp' is not a key of the run config; did you mean 'tp'?"),
        (["model=tiny", "impl=nowhere.Impl"], "impl._target_='nowhere.Impl' cannot be imported"),  # once
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
    assert not (tmp_path / "out").exists()  # nothing was launched, no folder was made


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


def test_the_launcher_and_its_ranks_collect_garbage_and_keep_openblas_to_one_thread(tmp_path):
    """Paused while the launcher and the forkserver import (`launcher.run.import_gc`), the
    collector runs again during the run, in the launcher and in every rank, with the objects
    the imports made frozen; numpy's OpenBLAS runs one thread in each (`forkserver.CPU_ENV`)."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}  # the harness sets it
    p = subprocess.run([sys.executable, "-m", "launcher", "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
                        "impl=tests.defects.RecordsProcessState", f"hydra.run.dir={tmp_path}/out",
                        "+hydra.callbacks.probe._target_=tests.defects.RecordsLauncherState"],
                       cwd=tmp_path, env=dict(env, PYTHONPATH=str(REPO), DSV4_TEST_PROCESS_STATE=str(state)),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    for who in ("launcher", "rank0", "rank1"):
        enabled, frozen, openblas = json.loads((tmp_path / f"state.{who}").read_text())
        assert enabled and frozen > 10_000 and openblas == 1, (who, enabled, frozen, openblas)


def test_print_only_flags_print_and_exit_0(tmp_path):
    p = run_cli(["--cfg", "job", "layer=csa", "tp=4"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "\ntp: 4\n" in p.stdout and "layer:\n  name: csa\n" in p.stdout
    assert not (tmp_path / "out").exists()


def test_a_sweeps_configs_print_and_exit_0(tmp_path):
    p = run_cli(["-m", "layer=swa,csa", "tp=1,2", "model=tiny", "--cfg", "job"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    headers = [ln for ln in p.stdout.splitlines() if ln.startswith("# job ")]
    assert headers == ["# job 0: layer=swa tp=1 model=tiny", "# job 1: layer=swa tp=2 model=tiny",
                       "# job 2: layer=csa tp=1 model=tiny", "# job 3: layer=csa tp=2 model=tiny"]
    configs = p.stdout.split("# job ")[1:]
    assert "layer:\n  name: csa\n" in configs[3] and "\ntp: 2\n" in configs[3] and "\ntp: 1\n" in configs[0]
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "out").exists()  # nothing ran


def test_a_sweeps_configs_with_a_bad_key_are_one_error_line(tmp_path):
    p = run_cli(["-m", "tpp=1,2", "--cfg", "job"], tmp_path, timeout=120)
    assert p.returncode == EXIT_ERROR and p.stderr.startswith("error: tpp=1,2: 'tpp' is not a key"), p.stderr
    assert len(p.stderr.splitlines()) == 1 and p.stdout == "", p.stdout + p.stderr


def test_help_is_a_page_of_keys_exit_codes_and_examples(tmp_path):
    p = run_cli(["--help"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    page = p.stdout
    assert "Exit status: 0 PASS" in page and "Examples:" in page and "dsv4-tp-harness -sc install=bash" in page
    assert "hidden_size: 4096" not in page and "_schema" not in page  # neither the config nor internal nodes
    for key in ("tp", "timeout_s", "impl", "golden_cache", "nnodes", "fault.kind", "bench.rounds"):
        assert f" {key}" in page, key
    # Every option of every group, and nothing else, as the config tree has them.
    groups = {ln.split()[0]: ln.split("(")[0].split()[1:] for ln in page.split("Groups (group=option):\n")[1]
              .split("\n\n")[0].splitlines()}
    for group, options in groups.items():
        if group == "model":  # the presets are Python (layers.contract.config.PRESETS): below
            continue
        folder = REPO / "configs" / group.lstrip("+")
        assert sorted(options) == sorted(f.stem for f in folder.glob("*.yaml")), group
    assert set(groups) == {"layer", "model", "tokens", "starts", "+sweep"}


def test_the_model_presets_in_the_help_are_the_presets():
    from layers.contract.config import PRESETS

    with initialize_config_module(config_module="configs", version_base=None):
        template = compose(config_name="config", return_hydra_config=True).hydra.help.template
    line = next(ln for ln in template.splitlines() if ln.strip().startswith("model "))
    assert sorted(line.split("(")[0].split()[1:]) == sorted(PRESETS)


def test_the_console_script_is_python_m_launcher():
    # Shell completion works through the console script: it must start as `python -m launcher`
    # does (the forkserver early, the same exit handling).
    from importlib.metadata import entry_points

    import launcher.__main__

    (script,) = entry_points(group="console_scripts", name="dsv4-tp-harness")
    assert script.load() is launcher.__main__.run


@pytest.mark.parametrize("args, code", [
    (["impl=layers.tp.TorchTP"], 0),
    (["impl=tests.defects.ReduceScatterWithoutSum"], 1),
    (["fault.kind=raise", "fault.rank=1"], 2),  # the raising rank's pytorch-errorfile-*.pickle
])
def test_a_run_leaves_nothing_in_the_temp_dir(tmp_path, args, code):
    # The launcher skips the interpreter's teardown at exit; the forkserver's socket folder
    # (multiprocessing's pymp-*) must still be removed.
    # A short folder of its own: the forkserver's socket path must fit AF_UNIX's 108 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="t") as tmp:
        p = run_cli(["layer=swa", "tp=2", "model=tiny", "golden_cache=null", *args], tmp_path,
                    timeout=120, env={"TMPDIR": tmp})
        assert p.returncode == code, p.stdout + p.stderr
        left = sorted(os.listdir(tmp))
        # torch's compile cache, which torch makes in the temp dir whenever anything imports
        # torch._inductor.config: not the harness's to remove. Two CI runs of the raising case
        # in about ten saw it appear, with a trigger not found since; it is reported, not failed.
        if TORCH_COMPILE_CACHE in left:
            left.remove(TORCH_COMPILE_CACHE)
            warnings.warn(f"{TORCH_COMPILE_CACHE} appeared in the run's TMPDIR ({' '.join(args)})")
        assert left == []
    # launcher.log is the run's record: what ran, the report, the exit status.
    log = (tmp_path / "out" / "launcher.log").read_text()
    assert "command line: layer=swa tp=2" in log and "VERDICT:" in log and f"exit status {code}" in log


def test_a_temp_dir_too_long_for_a_unix_socket_still_runs(tmp_path):
    tmp = tmp_path / ("t" * (120 - len(str(tmp_path))))
    tmp.mkdir()
    p = run_cli(["layer=swa", "tp=2", "model=tiny", "golden_cache=null"], tmp_path, timeout=120,
                env={"TMPDIR": str(tmp)})
    assert p.returncode == 0, p.stdout + p.stderr


def _launcher(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_impl_naming_a_function_runs_it_per_rank(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", impl="tests.defects.torch_tp_function", golden_cache=None)
    assert run.passed, run


def test_two_launchers_started_together_keep_two_results(tmp_path):
    # The default folder is ${fresh_dir:outputs/<date>/<time>}; here both launchers name the
    # same second on purpose.
    with initialize_config_module(config_module="configs", version_base=None):
        hydra_cfg = compose(config_name="config", return_hydra_config=True).hydra
    assert OmegaConf.to_container(hydra_cfg.run)["dir"].startswith("${fresh_dir:outputs/${now:")
    assert OmegaConf.to_container(hydra_cfg.sweep)["dir"].startswith("${fresh_dir:multirun/${now:")
    args = ["layer=swa", "tp=2", "model=tiny", "golden_cache=null", "hydra.run.dir=${fresh_dir:outputs/same}"]
    procs = [_launcher(args, tmp_path), _launcher([*args, "impl=tests.defects.PerturbRankTokens"], tmp_path)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 1], [p.communicate() for p in procs]
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "outputs").glob("same*/result.json"))]
    assert sorted(r["case"]["impl"] for r in results) == ["layers.tp.TorchTP", "tests.defects.PerturbRankTokens"]


@pytest.mark.parametrize("mode, folder_key, kept", [
    ([], "hydra.run.dir", ["result.json", "report.html", ".hydra/config.yaml", ".hydra/overrides.yaml"]),
    (["-m"], "hydra.sweep.dir", ["sweep.json", "0/result.json", "0/.hydra/overrides.yaml"]),
])
def test_a_second_launcher_on_a_folder_another_one_holds_is_refused_and_writes_nothing(tmp_path, mode, folder_key,
                                                                                         kept):
    """Two launchers given the same explicit output folder: the second, started while the first
    runs (here: holds on after writing its result), must not write over the first's files."""
    out, hold = tmp_path / "out", tmp_path / "hold"
    env = dict(os.environ, PYTHONPATH=str(REPO), DSV4_TEST_HOLD=str(hold))
    args = [sys.executable, "-m", "launcher", *mode, "layer=swa", "tp=2", "model=tiny", "golden_cache=null",
            f"{folder_key}={out}"]
    first = subprocess.Popen([*args, "+hydra.callbacks.hold._target_=tests.defects.HoldsTheLauncherAfterItsResult"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not Path(f"{hold}.held").exists():  # the first's result is written, its launcher still runs
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        written = {name: (out / name).read_bytes() for name in kept}
        second = subprocess.run([*args, "impl=tests.defects.PerturbRankTokens"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == EXIT_ERROR, second.stdout + second.stderr
        assert second.stderr.strip().startswith(f"error: output folder {out} is in use by another launcher"), \
            second.stderr
        assert {name: (out / name).read_bytes() for name in kept} == written
    finally:
        Path(f"{hold}.go").touch()
    assert first.wait(timeout=300) == 0, first.communicate()
    result = out / ("0/result.json" if mode else "result.json")
    assert json.loads(result.read_text())["case"]["impl"] == "layers.tp.TorchTP"
    if not mode:  # its launcher gone, the folder is free again: a later run may reuse it
        again = run_cli(["layer=swa", "tp=1", "model=tiny", "golden_cache=null"], tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.parametrize("args", [
    ["hydra.run.dir=FILE/sub"],
    ["hydra.run.dir=${fresh_dir:FILE/sub}"],
    ["-m", "hydra.sweep.dir=FILE/sub"],
])
def test_an_output_folder_that_cannot_be_created_is_one_error_line(tmp_path, args):
    (tmp_path / "file").write_text("")
    args = [a.replace("FILE", str(tmp_path / "file")) for a in args]
    p = _launcher(["layer=swa", "tp=1", "model=tiny", *args], tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_ERROR, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"{tmp_path}/file" in lines[0], err
