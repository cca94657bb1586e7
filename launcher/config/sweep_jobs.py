"""A multirun's jobs before any runs: each job's overrides, as the sweeper will expand them.

Apart from the sweep's reporting (`launcher.report.sweep_summary`), so that printing a sweep's configs
(`-m --cfg job`) reads them without the reporting's imports (torch among them)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf


def planned_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, in job order, as the harness's sweeper (and Hydra's basic one)
    expand this multirun (`expand_jobs`). None for another sweeper, whose jobs are not known
    in advance."""
    if not str(config.hydra.sweeper.get("_target_", "")).endswith(("BasicSweeper", "HarnessSweeper")):
        return None
    hydra = GlobalHydra.instance()  # its config loader lists a group's options for `glob(...)`
    parser = OverridesParser.create(config_loader=hydra.config_loader() if hydra.is_initialized() else None)
    return expand_jobs(config.hydra.sweeper.get("params") or {},
                       list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False)), parser)


def expand_jobs(params: Mapping[str, Any], arguments: Sequence[str],
                parser: OverridesParser | None = None) -> list[list[str]]:
    """Each job's overrides, in job order, as Hydra's basic sweeper expands them: `params`
    (a sweep file's `hydra.sweeper.params`) first, then `arguments` (the command line); a key
    given twice keeps its first place and its last value; the cartesian product of the swept
    values. `parser`: one made with Hydra's config loader, which a sweep over a group's options
    (`layer=glob(*)`) needs to list them."""
    parser = parser or OverridesParser.create()
    choices: dict[str, list[str]] = {}
    for override in parser.parse_overrides([*(f"{k}={v}" for k, v in params.items()), *arguments]):
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException("The harness's sweeper does not support sweep type : "
                                 f"{override.value_type.name if override.value_type else override}")
    return [list(job) for job in itertools.product(*choices.values())]
