"""A multirun's jobs before any runs: each job's overrides, as the sweeper will expand them.

Apart from the sweep's reporting (`launcher.report.sweep`), so that printing a sweep's configs
(`-m --cfg job`) reads them without the reporting's imports (torch among them)."""

from __future__ import annotations

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.dsv4_tp_harness.sweep import expand_jobs


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
