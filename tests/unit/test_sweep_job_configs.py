"""A sweep's job configs set on a copy of another job's (`launcher.config.sweep_compose`) are
exactly the configs Hydra composes for those jobs (`load_sweep_config`): every node's type,
flags, metadata and value, and the root's resolver cache; and only jobs that differ from a
composed one in plain values are made so."""

from __future__ import annotations

import pytest
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import Container, DictConfig, ListConfig, open_dict

import hydra_plugins.dsv4_tp_harness.harness_sweeper  # noqa: F401  (registers hydra/sweeper=harness)
from launcher.config import resolvers  # noqa: F401  (the config's resolvers)
from launcher.config.sweep_compose import PlainValues, compose_jobs, with_values
from launcher.config.sweep_jobs import expand_jobs


def _facts(node, path: str = "") -> list:
    """Everything that tells two configs apart: each node's path, class, metadata (flags,
    types, the root's resolver cache) and, for a leaf, its value."""
    facts = [(path, type(node).__name__, dict(vars(node._metadata)))]
    content = node._content if isinstance(node, Container) else node._value()
    if isinstance(node, DictConfig) and isinstance(content, dict):
        for key, child in content.items():
            facts += _facts(child, f"{path}.{key}")
    elif isinstance(node, ListConfig) and isinstance(content, list):
        for i, child in enumerate(content):
            facts += _facts(child, f"{path}[{i}]")
    else:
        facts.append((path, "value", content))
    return facts


@pytest.fixture
def hydra_loader():
    with initialize_config_module(config_module="configs", version_base=None):
        yield GlobalHydra.instance().config_loader()


def _sweep(loader, command_line: list[str]):
    """The master config of `python -m launcher -m COMMAND_LINE`, and its jobs' overrides."""
    master = loader.load_configuration(config_name="config", overrides=command_line, run_mode=RunMode.MULTIRUN)
    jobs = expand_jobs(master.hydra.sweeper.params or {}, command_line, OverridesParser.create(config_loader=loader))
    return master, jobs


def _fast_path(loader, master, jobs):
    """The jobs' configs by `compose_jobs`, and the jobs Hydra composed for it."""
    composed = []

    def compose(job):
        composed.append(job)
        return loader.load_sweep_config(master_config=master, sweep_overrides=job)

    configs = compose_jobs(jobs, PlainValues(loader.repository.group_exists), master,
                           lambda firsts: [compose(job) for job in firsts], compose)
    return configs, composed


SWEEPS = {
    # a sweep file's params (a `+sweep=` group), its layers' own defaults (tp) overridden
    "smoke": (["+sweep=smoke", "golden_cache=null"], 3),
    "prefill": (["+sweep=prefill", "seed=1,2"], 1),
    # groups that change the defaults list (tolerance, starts, model) beside values set over a
    # group's own (tp over layer's, start_pos over starts=mixed's, integrity over tolerance's)
    "groups and values": (["layer=swa,csa", "model=tiny", "tolerance=default,reference", "tp=1,2",
                           "integrity=true,false", "+starts=mixed", "start_pos=3,null"], 4),
    # values in nested nodes, strings and nulls; a list value is no plain value
    "nested values": (["layer=hca", "model=tiny,mini", "model.rope_theta=10000.0,160000", "fault.kind=null,raise",
                       "impl._target_=layers.tp.TorchTP,tests.defects.PerturbRankTokens", "start_pos=5,[1,2]"], 4),
}


@pytest.mark.parametrize("name", SWEEPS)
def test_each_jobs_config_is_the_one_hydra_composes(hydra_loader, name):
    command_line, firsts = SWEEPS[name]
    master, jobs = _sweep(hydra_loader, command_line)
    configs, composed = _fast_path(hydra_loader, master, jobs)
    assert len(composed) == firsts < len(jobs)  # one composition per choice of groups and kind of value
    for job, config in zip(jobs, configs):
        hydra_own = hydra_loader.load_sweep_config(master_config=master, sweep_overrides=job)
        assert _facts(config) == _facts(hydra_own), job


def test_the_comparison_sees_a_config_set_from_the_wrong_job(hydra_loader):
    master, jobs = _sweep(hydra_loader, ["layer=swa", "model=tiny", "tp=1,2", "seed=1,2"])
    configs, _ = _fast_path(hydra_loader, master, jobs)
    hydra_own = [hydra_loader.load_sweep_config(master_config=master, sweep_overrides=job) for job in jobs]
    for i, config in enumerate(configs):
        for j, other in enumerate(hydra_own):
            assert (_facts(config) == _facts(other)) == (i == j), (i, j)


def test_a_value_the_config_refuses_raises_hydras_own_error_for_the_first_bad_job(hydra_loader):
    master, jobs = _sweep(hydra_loader, ["layer=swa", "model=tiny", "tp=1,abc,two"])
    with pytest.raises(ConfigCompositionException, match="tp=abc"):
        _fast_path(hydra_loader, master, jobs)


@pytest.mark.parametrize("command_line", [
    ["model=tiny", "layer=swa,csa"],  # a group
    ["model=tiny", "+extra=1,2"],  # an addition
    ["model=tiny", "start_pos=[1,2],[3,4]"],  # a list
    ["model=tiny", "model.hidden_size=64,128", "model={hidden_size:32}"],  # a node above another override's key
])
def test_what_is_no_plain_value_is_composed_by_hydra(hydra_loader, command_line):
    master, jobs = _sweep(hydra_loader, command_line)
    configs, composed = _fast_path(hydra_loader, master, jobs)
    assert composed == jobs
    for job, config in zip(jobs, configs):
        assert _facts(config) == _facts(hydra_loader.load_sweep_config(master_config=master, sweep_overrides=job))


def test_a_value_that_is_no_leaf_of_the_first_jobs_config_is_not_set_on_a_copy(hydra_loader):
    master, (job,) = _sweep(hydra_loader, ["layer=swa", "model=tiny"])
    template = hydra_loader.load_sweep_config(master_config=master, sweep_overrides=job)
    parse = PlainValues(lambda key: False).parse

    def set_from_the_template(key, first, second):
        return with_values(template, parse([*job, f"{key}={first}"]), parse([*job, f"{key}={second}"]), master)

    assert set_from_the_template("seed", 1, 2).seed == 2
    with open_dict(template):
        template.extra = {"a": 1}  # a node with keys of its own, which a value would replace
    assert set_from_the_template("extra", 1, 2) is None
    with open_dict(template.hydra.runtime.choices):
        template.hydra.runtime.choices.seed = "1"  # a group's choice (one only a config's search path adds)
    assert set_from_the_template("seed", 1, 2) is None
