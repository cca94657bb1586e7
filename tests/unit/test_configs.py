"""The Hydra config tree composes, and its model presets are exactly the Python presets."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import launcher.cli  # noqa: F401  (registers the schemas)
from launcher.config.schema import layer_groups, refused_overrides, with_layer
from launcher.config.spec import run_spec
from layers.contract.case import CASE_KEYS
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


@pytest.mark.parametrize("layer", ["swa", "csa", "hca", "moe"])
def test_every_layer_option_composes(layer):
    assert _compose(f"layer={layer}").layer.name == layer


@pytest.mark.parametrize("layer, group", sorted(layer_groups().items()))
def test_each_layer_group_gives_every_key_of_its_set_a_default(layer, group):
    """A key of the set the group names but not given a default would be MISSING at run time."""
    keys = [f.name for f in dataclasses.fields(CASE_KEYS[group["key_set"]])]
    assert list(group["keys"]) == keys, layer
    assert run_spec(_compose(f"layer={layer}", "model=tiny"), "/x").case.group_size == group["keys"][keys[0]]


def test_a_key_of_another_layer_is_refused_by_the_schema():
    assert run_spec(_compose("layer=moe", "ep=4", "model=tiny"), "/x").case.ep == 4
    with pytest.raises(ConfigCompositionException, match="tp"):
        _compose("layer=moe", "tp=2")
    with pytest.raises(ConfigCompositionException, match="num_tokens"):
        _compose("layer=csa", "num_tokens=2")


@pytest.mark.parametrize("overrides, refusal", [
    (["layer=moe", "tp=2"], "tp=2 does not apply to layer=moe: tp is a key of layer=block, csa, hca, swa; "
                            "layer=moe takes ep, layer_id, num_tokens, balanced_routing"),
    (["num_tokens=64"], "num_tokens=64 does not apply to layer=swa: num_tokens is a key of layer=moe"),
    (["layer=swa,moe", "local_t=8"], "local_t=8 does not apply to layer=moe"),
    (["layer=moe", "tpp=2"], "'tpp' is not a key of the run config; did you mean 'tp'?"),
])
def test_overrides_that_would_not_compose_are_refused_in_the_users_words(overrides, refusal):
    assert refusal in refused_overrides(overrides)


@pytest.mark.parametrize("overrides", [["layer=moe", "ep=4"], ["layer=csa", "tp=8"], ["tp=2"], ["layer=swa,csa", "tp=1,2"]])
def test_overrides_of_the_layers_run_are_not_refused(overrides):
    assert refused_overrides(overrides) is None


def test_a_replayed_snapshots_layer_takes_its_own_keys():
    moe = with_layer(_compose("layer=swa", "model=tiny", "seed=3"), "moe")
    assert (moe.layer.name, moe.ep, moe.seed, "tp" in moe) == ("moe", 2, 3, False)


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
