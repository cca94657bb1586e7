"""The Hydra config tree composes, and its model presets are exactly the Python presets."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import launcher.cli  # noqa: F401  (registers the schemas)
from launcher.config.spec import run_spec
from layers.contract.config import PRESETS


def _compose(*overrides: str):
    with initialize_config_module(config_module="configs", version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_yaml_equals_python_preset(name):
    cfg = _compose(f"model={name}")
    assert OmegaConf.to_container(cfg.model) == dataclasses.asdict(PRESETS[name])


def test_defaults_are_the_documented_ones():
    spec = run_spec(_compose(), "/tmp/x")
    assert (spec.case.layer, spec.case.model.name, spec.case.tp) == ("swa", "flash", 4)
    assert spec.case.local_t == 128  # the rank capacity 64*8/4
    assert spec.impl == {"_target_": "layers.tp.TorchTP"}
    assert spec.backend == "auto"


@pytest.mark.parametrize("layer", ["swa", "csa", "hca"])
def test_every_layer_option_composes(layer):
    assert _compose(f"layer={layer}").layer.name == layer


def test_start_pos_scalar_and_list():
    assert run_spec(_compose("start_pos=5"), "/x").case.start_pos == 5
    assert run_spec(_compose("start_pos=[1,2]"), "/x").case.start_pos == (1, 2)


def test_threads_rule_never_oversubscribes(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert run_spec(_compose("tp=8"), "/x").threads() == 1
    assert run_spec(_compose("tp=1"), "/x").threads() == 2
    assert run_spec(_compose("tp=2", "threads_per_rank=3"), "/x").threads() == 3


def test_threads_rule_counts_only_the_cpus_this_process_may_run_on():
    # As under `taskset -c 0`, a cpuset or Slurm's --cpus-per-task=1, on a machine with more.
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert run_spec(_compose("tp=1"), "/x").threads() == 1
    finally:
        os.sched_setaffinity(0, before)
