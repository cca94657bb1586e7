"""The default sweeper and launcher of `python -m launcher -m`: Hydra's basic ones, with every
job's config composed once instead of twice.

Hydra's basic sweeper composes each job's config before any job runs (a sweep with a job
that cannot be composed is refused whole), and its basic launcher composes each again to run
it. A composition takes 0.1 to 0.2 s, more than a tiny job's own overhead: here the sweeper
composes one job per choice of config groups, sets each other job's plain values on a copy of
that job's config as Hydra's override step sets them (`launcher.config.sweep_compose`), composes
on every core (`compose_all`: forked copies of this process, which already holds Hydra's state)
and hands the configs to the launcher it instantiated (`HarnessLauncher.composed`, by the job's
overrides), which composes only a job it was not given (one planned by another sweeper).
Everything else is the basic pair's: the same jobs in the same order (`expand_jobs`),
`params`, `max_batch_size`, the sweep's `multirun.yaml`, jobs one after another in this
process through Hydra's own job runner (`hydra.core.utils.run_job`: each job's folder,
`.hydra/` files, logging and callbacks).
A parallel launcher (`hydra/launcher=joblib`, `=slurm`) works with this sweeper as with the
basic one and composes its jobs itself.

Imported by every Hydra application's plugin scan: Hydra, OmegaConf and the launcher's torch-free
job expansion (`launcher.config.sweep_jobs`), nothing heavy;
and no `from __future__ import annotations`: the scan runs the module without registering it
in sys.modules, where dataclasses look string annotations up.
"""

import logging
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import CompactHydraException, HydraException
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher.config.sweep_compose import PlainValues, compose_jobs
from launcher.config.sweep_jobs import expand_jobs

log = logging.getLogger(__name__)


# A forked copy of this process costs a few milliseconds and each config comes back pickled
# (a few milliseconds more), against 0.1 to 0.2 s a composition: every core gets a job.
# A copy's share normally takes 0.1 to 0.2 s a job; one that takes far longer (a copy stuck
# in a lock some other thread held at the fork) is ended and its jobs composed here.
COPY_GRACE_S, COPY_S_PER_JOB = 30.0, 2.0


def compose_all(compose: Callable[[list[str]], DictConfig], jobs: Sequence[Sequence[str]]) -> list[DictConfig]:
    """`compose(job)` of every job, in job order, on up to one forked copy of this process per
    usable core (copy k composes jobs k, k + n, ... and sends its configs back pickled).

    The same configs as composed one after another here (a copy is this process: Hydra's
    state and the master config's resolver cache included), and the same error: a job a copy
    could not compose, or whose config did not come back, is composed here again, in job
    order, so the first bad job raises Hydra's own exception from this process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    copies = max(1, min(cores, len(jobs))) if hasattr(os, "fork") else 1
    composed: list[Optional[DictConfig]] = [None] * len(jobs)
    children: dict[int, int] = {}  # pid -> read end of its pipe
    try:
        for k in range(1, copies):
            read_end, write_end = os.pipe()
            try:
                pid = os.fork()
            except OSError:  # no process to spare (a ulimit): this copy's jobs are composed below
                os.close(read_end)
                os.close(write_end)
                break
            if pid == 0:
                _compose_share(compose, jobs, range(k, len(jobs), copies), write_end)
            os.close(write_end)
            children[pid] = read_end
        for i in range(0, len(jobs), copies):
            try:
                composed[i] = compose(list(jobs[i]))
            except Exception:
                pass  # raised below, in job order
        deadline = time.monotonic() + COPY_GRACE_S + COPY_S_PER_JOB * -(-len(jobs) // copies)
        for pid, read_end in children.items():
            try:
                for i, config in pickle.loads(_receive(read_end, deadline)):
                    composed[i] = config
            except Exception:
                pass  # a copy that died, sent nothing or ran out of time: its jobs are composed below
    finally:
        for pid, read_end in children.items():
            os.close(read_end)
            try:
                os.kill(pid, signal.SIGKILL)  # it has ended unless it was stuck or this process was interrupted
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
    return [config if config is not None else compose(list(job)) for config, job in zip(composed, jobs)]


def _compose_share(compose: Callable[[list[str]], DictConfig], jobs: Sequence[Sequence[str]],
                   share: range, write_end: int) -> None:
    """A forked copy's life: compose its share, send `[(job index, config)]`, and end at once
    (no atexit handler or finalizer of the launcher runs twice)."""
    try:
        configs = []
        for i in share:
            try:
                configs.append((i, compose(list(jobs[i]))))
            except Exception:
                pass  # composed again in the parent, which raises its error
        with os.fdopen(write_end, "wb") as out:
            pickle.dump(configs, out, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        os._exit(0)


def _receive(read_end: int, deadline: float) -> bytes:
    """Everything a copy writes until it closes its end, or TimeoutError at the deadline."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_end], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(read_end, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


@dataclass
class HarnessSweeperConf:
    _target_: str = "hydra_plugins.dsv4_tp_harness.harness_sweeper.HarnessSweeper"
    max_batch_size: Optional[int] = None  # jobs composed and launched at a time; null = all
    params: Optional[dict[str, str]] = field(default=None)  # swept keys: `layer: swa,csa`


@dataclass
class HarnessLauncherConf:
    _target_: str = "hydra_plugins.dsv4_tp_harness.harness_sweeper.HarnessLauncher"


class HarnessSweeper(Sweeper):
    """The basic sweeper's jobs, each composed once: the launcher is handed the configs."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Mapping[str, str]] = None):
        super().__init__()
        if max_batch_size is not None and max_batch_size <= 0 and max_batch_size != -1:
            raise HydraException(f"hydra.sweeper.max_batch_size={max_batch_size}: a positive number of jobs, or null")
        self.max_batch_size = None if max_batch_size == -1 else max_batch_size
        self.params = dict(params or {})
        self.hydra_context: Optional[HydraContext] = None
        self.config: Optional[DictConfig] = None
        self.launcher: Optional[Launcher] = None
        self._folders: dict[str, int] = {}  # each job's output folder (resolved subdir) -> its job number

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        """The jobs; a sweep that does not reach its end (interrupted, a launcher that failed,
        a batch refused) still gets its summary, and ends the application with its status
        (`launcher.report.sweep_summary.unfinished_status`): every way out passes here."""
        assert self.config is not None
        try:
            return self._sweep(arguments)
        except BaseException as e:
            from launcher.report.sweep_summary import unfinished_status  # only now: the plugin scan stays light

            if not isinstance(e, (SystemExit, KeyboardInterrupt)):
                print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            raise SystemExit(unfinished_status(str(self.config.hydra.sweep.dir), e)) from None

    def _sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs = expand_jobs(self.params, arguments, parser)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        size = self.max_batch_size or max(len(jobs), 1)
        returns = []
        for start in range(0, len(jobs), size):
            batch = jobs[start:start + size]
            composed = self._compose_batch(batch)
            self._check_own_folders(batch, composed, start)
            if isinstance(self.launcher, HarnessLauncher):
                self.launcher.composed = composed
            try:
                results = self.launcher.launch(batch, initial_job_idx=start)
            finally:
                if isinstance(self.launcher, HarnessLauncher):
                    self.launcher.composed = {}
            for r in results:
                _ = r.return_value  # a job that raised raises here, as with the basic sweeper
            returns.append(results)
        return returns

    def _compose_batch(self, batch: Sequence[Sequence[str]]) -> dict[tuple[str, ...], DictConfig]:
        """Compose every job of the batch (a bad one refuses the sweep before any job runs):
        each config by its job's overrides, for the launcher."""
        assert self.hydra_context is not None and self.config is not None
        loader, master = self.hydra_context.config_loader, self.config

        def compose(job: list[str]) -> DictConfig:
            return loader.load_sweep_config(master_config=master, sweep_overrides=job)

        def compose_or_none(job: list[str]) -> Optional[DictConfig]:
            try:
                return compose(job)
            except Exception:
                return None  # composed again in job order, where it raises Hydra's error

        plain = PlainValues(loader.repository.group_exists)
        configs = compose_jobs(batch, plain, master, lambda firsts: compose_all(compose_or_none, firsts), compose)
        return {tuple(overrides): config for overrides, config in zip(batch, configs)}

    def _check_own_folders(self, batch: Sequence[Sequence[str]], composed: Mapping[tuple[str, ...], DictConfig],
                           start: int) -> None:
        """Refuse a sweep two of whose jobs would write into one folder (`hydra.sweep.subdir`
        fixed, or naming nothing the jobs vary): each job's result.json would replace the
        other's, and a job would be reported as having written none."""
        assert self.config is not None
        for idx, overrides in enumerate(batch, start=start):
            config = composed[tuple(overrides)]
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = idx  # as the launcher sets them
            try:
                folder = str(config.hydra.sweep.subdir)
            except Exception:  # the launcher reports a subdir that cannot be resolved
                continue
            first = self._folders.setdefault(folder, idx)
            if first != idx:
                given = OmegaConf.to_container(self.config.hydra.sweep, resolve=False)["subdir"]
                raise CompactHydraException(  # one line, as a composition error is
                    f"hydra.sweep.subdir={given} gives jobs {first} and {idx} the same folder {folder!r}: each "
                    f"job's result.json would replace the other's; keep its default ${{hydra.job.num}} or "
                    f"name what the jobs vary in it (e.g. ${{hydra.job.override_dirname}})")


class HarnessLauncher(Launcher):
    """The basic launcher: jobs one after another in this process, each from the config the
    sweeper composed for it (composed here only where none was)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        # Job overrides -> the config the sweeper composed for that job, for the batch it launches.
        self.composed: dict[tuple[str, ...], DictConfig] = {}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally")
        runs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.composed.pop(tuple(overrides), None)
            if sweep_config is None:
                sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            runs.append(run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                                config=sweep_config, job_dir_key="hydra.sweep.dir",
                                job_subdir_key="hydra.sweep.subdir"))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


ConfigStore.instance().store(group="hydra/sweeper", name="harness", node=HarnessSweeperConf, provider="dsv4_tp_harness")
ConfigStore.instance().store(group="hydra/launcher", name="harness", node=HarnessLauncherConf,
                             provider="dsv4_tp_harness")
