"""`-m ... --cfg job|hydra|all`: print the config of every job of a multirun, launch nothing.

Hydra refuses `--cfg` together with `--multirun`. This composes the multirun once to learn its
jobs (as the basic sweeper expands them: `hydra.sweeper.params`, then the command line), then
each job's config with that job's overrides, and prints them one after another under a
`# job N: overrides` header.
"""

from __future__ import annotations

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from launcher.config.sweep_jobs import planned_jobs

_MULTIRUN = ("-m", "--multirun")
_CFG = ("-c", "--cfg")
_CFG_TYPES = ("job", "hydra", "all")


def wants_sweep_configs(argv: list[str]) -> bool:
    """Whether the command line asks for a multirun's configs (`-m` with `--cfg`)."""
    return any(a in _MULTIRUN for a in argv) and any(a in _CFG or a.split("=", 1)[0] in _CFG for a in argv)


def print_sweep_configs(argv: list[str]) -> str | None:
    """Print every job's config; None, or why the command line cannot be shown this way."""
    cfg_type, resolve, overrides = None, False, []
    args = iter(argv)
    for a in args:
        if a in _MULTIRUN:
            continue
        if a in _CFG:
            cfg_type = next(args, None)
        elif a.split("=", 1)[0] in _CFG:
            cfg_type = a.split("=", 1)[1]
        elif a == "--resolve":
            resolve = True
        elif a.startswith("-"):
            return f"{a} cannot be combined with -m and --cfg"
        else:
            overrides.append(a)
    if cfg_type not in _CFG_TYPES:
        return f"--cfg takes one of {', '.join(_CFG_TYPES)}, not {cfg_type!r}"
    with initialize_config_module(config_module="configs", version_base=None):
        sweep = GlobalHydra.instance().hydra.compose_config(
            "config", overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=False)
        jobs = planned_jobs(sweep)
        if jobs is None:
            return "the jobs of this sweeper are not known before it runs: --cfg needs the harness's or the basic sweeper"
        # Not part of a job's own list: Hydra's keys and groups (`hydra/launcher=slurm` with its
        # `hydra.launcher.partition=...`) hold for every job.
        hydra_overrides = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
        for num, job in enumerate(jobs):
            cfg = compose("config", overrides=job + hydra_overrides, return_hydra_config=cfg_type != "job")
            shown = {"hydra": cfg.hydra} if cfg_type == "hydra" else cfg
            print(f"# job {num}: {' '.join(job)}")
            print(OmegaConf.to_yaml(shown, resolve=resolve))
    return None
