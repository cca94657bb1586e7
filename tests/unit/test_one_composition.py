"""`composed_once`: Hydra's entry composes the command line's config once instead of twice, and
every job sees exactly the config (Hydra's own node included) it sees without it; a command
line Hydra refuses is refused with the same message."""

from __future__ import annotations

import sys

import hydra
import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

import launcher.config  # noqa: F401  (registers the schemas and resolvers the config needs)
from launcher.config.one_composition import composed_once

HYDRA_LOAD = ConfigLoaderImpl.load_configuration
# Set by Hydra as the job runs, not by the composition.
_RUNTIME_KEYS = ("output_dir",)


@pytest.fixture
def hydra_app():
    """Hydra's application object for the harness's config, as its entry makes it."""
    app = Hydra.create_main_hydra2(task_name="t", config_search_path=create_config_search_path("pkg://configs"))
    yield app
    GlobalHydra.instance().clear()


def _entry(record: list):
    @hydra.main(config_path="pkg://configs", config_name="config", version_base=None)
    def task(cfg) -> None:
        hc = OmegaConf.to_container(HydraConfig.get(), resolve=False)
        for key in _RUNTIME_KEYS:
            hc["runtime"].pop(key, None)
        hc["job"].pop("num", None)
        record.append((OmegaConf.to_yaml(cfg), OmegaConf.to_yaml(hc)))

    return task


def _run(argv: list[str], monkeypatch, capsys, once: bool) -> tuple[list, list[list[str]], str, object]:
    """Hydra's entry on `argv`: the configs its jobs saw, the override lists Hydra composed
    a primary config of (calls of the loader itself), stderr and the exit code."""
    record, calls = [], []

    def counted(loader, config_name, overrides, run_mode, **kwargs):
        calls.append(list(overrides))
        return HYDRA_LOAD(loader, config_name, overrides, run_mode, **kwargs)

    code = None
    with monkeypatch.context() as patch:
        patch.setattr(ConfigLoaderImpl, "load_configuration", counted)
        patch.setattr(sys, "argv", ["launcher", *argv])
        try:
            if once:
                with composed_once(argv):
                    _entry(record)()
            else:
                _entry(record)()
        except SystemExit as e:
            code = e.code
        assert ConfigLoaderImpl.load_configuration is counted  # put back as it was
    return record, calls, capsys.readouterr().err, code


def _both(argv: list[str], tmp_path, monkeypatch, capsys):
    """`argv` with the test's own output folders, then `_run` of it without and with `composed_once`."""
    argv = [*argv, f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    monkeypatch.chdir(tmp_path)
    return argv, _run(argv, monkeypatch, capsys, once=False), _run(argv, monkeypatch, capsys, once=True)


def _primary(calls: list[list[str]], argv: list[str]) -> int:
    """Compositions of the command line's own config (a sweep's jobs add overrides of their own)."""
    given = [a for a in argv if not a.startswith("-")]
    return sum(1 for c in calls if c[:len(given)] == given and all(o.startswith("hydra.mode=") for o in c[len(given):]))


@pytest.mark.parametrize("argv", [
    ["layer=csa", "tp=2", "model=tiny"],
    ["hydra.job.name=other", "seed=7", "+extra=1"],
    ["hydra.mode=RUN", "layer=hca"],
    ["-m", "layer=swa,hca", "model=tiny"],
    ["--multirun", "tp=1,2"],
], ids=["run", "hydra-override", "mode-given", "multirun", "multirun-long"])
def test_one_composition_gives_every_job_hydras_config(argv, tmp_path, monkeypatch, capsys):
    argv, (twice, calls_twice, _, code_twice), (once, calls_once, _, code_once) = _both(argv, tmp_path, monkeypatch, capsys)
    assert twice and once == twice
    assert code_once == code_twice
    assert _primary(calls_twice, argv) == 2
    assert _primary(calls_once, argv) == 1


@pytest.mark.parametrize("argv", [
    ["tp=1,2"],                                # a sweep without -m
    ["no_such_key=1"],                         # not in the schema
    ["layer=nope"],                            # no such option
    ["hydra.mode=MULTIRUN", "layer=swa,hca"],  # the mode set on the command line: Hydra's own get_mode
    ["--cfg=nothing"],                         # refused by Hydra's command-line parser
], ids=["sweep-without-m", "unknown-key", "unknown-option", "mode-multirun", "bad-flag"])
def test_what_hydra_refuses_or_reads_its_own_way_is_unchanged(argv, tmp_path, monkeypatch, capsys):
    _, (twice, _, err_twice, code_twice), (once, _, err_once, code_once) = _both(argv, tmp_path, monkeypatch, capsys)
    assert (once, err_once, code_once) == (twice, err_twice, code_twice)
    assert twice or code_twice  # each case either ran its jobs or was refused


def test_a_composition_with_other_overrides_is_hydras_own(hydra_app, monkeypatch):
    """Only the one override Hydra appends is applied to the kept config: a composition asked
    with any other extra override is composed afresh."""
    calls = []
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration",
                        lambda loader, config_name, overrides, run_mode, **kw: calls.append(list(overrides))
                        or HYDRA_LOAD(loader, config_name, overrides, run_mode, **kw))
    with composed_once(["tp=2"]):
        assert hydra_app.get_mode("config", ["tp=2"]) is None
        cfg = hydra_app.config_loader.load_configuration("config", ["tp=2", "seed=3"], RunMode.RUN)
    assert calls == [["tp=2"], ["tp=2", "seed=3"]]
    assert cfg.seed == 3


@pytest.mark.parametrize("run_mode", ["RUN", "MULTIRUN"])
def test_the_kept_config_takes_the_mode_hydra_appends(hydra_app, run_mode):
    """The second call, with Hydra's `hydra.mode=<mode>` appended, gets the config Hydra itself
    composes for those overrides (compared before Hydra's run sets anything on it)."""
    mode = RunMode[run_mode]
    argv = ["-m"] if mode == RunMode.MULTIRUN else []
    overrides = ["layer=csa", "hydra.job.name=x"]
    with composed_once(argv):
        assert hydra_app.get_mode("config", overrides) is None
        kept = hydra_app.config_loader.load_configuration("config", [*overrides, f"hydra.mode={run_mode}"], mode)
    fresh = HYDRA_LOAD(hydra_app.config_loader, "config", [*overrides, f"hydra.mode={run_mode}"], mode)
    assert kept.hydra.mode == mode
    assert OmegaConf.to_yaml(kept) == OmegaConf.to_yaml(fresh)


def test_a_hydra_without_the_internals_is_left_as_it_is(monkeypatch):
    monkeypatch.delattr(Hydra, "get_mode")
    load = ConfigLoaderImpl.load_configuration
    with composed_once(["tp=2"]):
        assert ConfigLoaderImpl.load_configuration is load
    assert not hasattr(Hydra, "get_mode")
