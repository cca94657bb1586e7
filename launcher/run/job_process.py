"""Sweep jobs in a process of their own, under a Hydra launcher that runs the jobs in a pool of
worker processes (joblib's loky): a job whose process dies is that job's ERROR, never the pool's.

loky treats the death of any of its workers as a broken pool (`TerminatedWorkerError`): it
kills the workers running the other jobs and never starts the sweep's later ones, whose rows
then read "never started". So a worker does not run its jobs itself: it hands each to its job
process (`JobProcess`), a child forked at its first job that runs job after job (keeping
its forkserver and warm ranks between them, as the worker would) and is replaced when it
dies. A job process that ends before the job's result is written (os._exit, SIGKILL, the OOM
killer) leaves the worker standing; the worker writes the job's result then, an ERROR saying
how the job's process ended, and takes the next job.

Each link dies with the one above it (`launcher.run.lifeline`): the worker with the sweep's
launcher, even SIGKILLed (`SWEEP_PID_ENV`: loky starts its workers from the launcher, which
names itself here), armed as the worker starts (loky's initializer: a worker that never got a
job would otherwise outlive it until loky's idle timeout), and the job process with the
worker. SIGTERM or SIGINT of the sweep's launcher, which runs no job itself, stops the sweep as
an interruption (`PooledSweep`): joblib kills its workers, with their jobs, and the summary is
written.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from launcher.config.job_slot import runs_in_a_pool
from launcher.run import lifeline

# The pid of the sweep's launcher process, set there before its pool starts any worker.
SWEEP_PID_ENV = "DSV4_TP_SWEEP_PID"
# The exit status of a job process whose job raised past `launcher.job.execute` (which never
# should): an error.
_CRASHED = 2


def name_sweep_process() -> None:
    """In the sweep's launcher: name it as the process its pool's workers must die with."""
    os.environ[SWEEP_PID_ENV] = str(os.getpid())


def die_with_sweep() -> None:
    """In a pool worker, as it starts: be killed when the sweep's launcher ends."""
    parent = os.environ.get(SWEEP_PID_ENV)
    if parent is not None:
        lifeline.die_with_parent(int(parent))


class JobProcess:
    """A child of this process that runs the jobs it is sent, one at a time, with the job's
    logging and working folder as Hydra set them up here."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._conn = None

    def run(self, job: Callable[..., int], *args) -> tuple[int | None, str]:
        """`job(*args)` (picklable, returning an exit status) in the job process, started first
        if there is none; `(status, how)`: its exit status, or None and how the process ended
        when it died during the job."""
        try:
            message = pickle.dumps((job, args, _job_logging(), os.getcwd()), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a config that cannot be sent (an object of a user's plugin): run here, as before
            return job(*args), "returned"
        if self._pid is None:
            self._start()
        try:
            self._conn.send_bytes(message)
            return self._conn.recv(), "returned"
        except (EOFError, OSError):  # it died: how, from its exit status
            self._conn.close()
            _, wait_status = os.waitpid(self._pid, 0)
            self._pid = self._conn = None
        if os.WIFSIGNALED(wait_status):
            return None, f"was killed by {signal.Signals(os.WTERMSIG(wait_status)).name}"
        return None, f"exited with status {os.WEXITSTATUS(wait_status)}"

    def _start(self) -> None:
        parent = os.getpid()
        ours, theirs = multiprocessing.Pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs, parent)
        theirs.close()
        self._pid, self._conn = pid, ours


def _job_logging() -> tuple[dict, Any]:
    """The job's logging as Hydra set it up in this worker for the job (`hydra.job_logging`,
    resolved here, and `hydra.verbose`), for the job process to set up the same."""
    hydra = HydraConfig.get()
    verbose = hydra.verbose
    return (OmegaConf.to_container(hydra.job_logging, resolve=True),
            OmegaConf.to_container(verbose) if isinstance(verbose, ListConfig) else verbose)


def _serve(conn, parent: int) -> None:
    """The job process's life: jobs from `conn` until the worker is gone, each with the logging
    and working folder the worker set up for it and the warm ranks of its earlier jobs (`pool`);
    then they leave and it ends."""
    # Imported here, in a sweep's job process: Hydra makes this module's callback for every
    # run, also one its config refuses, which must not import torch (rank_group's).
    from launcher.run import rank_group

    pool = rank_group.GroupPool()
    try:
        lifeline.die_with_parent(parent)
        while True:
            try:
                job, args, (logging, verbose), cwd = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the worker is gone, or closed the pool
                break
            configure_log(OmegaConf.create(logging), verbose)
            os.chdir(cwd)
            try:
                status = job(*args, pool=pool)
            except SystemExit as e:  # an interrupted job: 128 + the signal
                status = e.code if isinstance(e.code, int) else _CRASHED
            except BaseException:
                traceback.print_exc()
                status = _CRASHED
            sys.stdout.flush()
            sys.stderr.flush()
            conn.send(status)
    finally:
        try:
            pool.close()  # the warm ranks the last jobs left
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


# This worker's job process (a pool worker runs one job at a time).
JOB_PROCESS = JobProcess()


def _interrupt(signum, frame):
    raise SystemExit(128 + signum)


class PooledSweep(Callback):
    """In the launcher of a sweep whose jobs run in a pool of workers: names the process its
    workers die with (each from its start), and makes SIGTERM and SIGINT end the sweep as an
    interruption (exit status 128 + the signal, with its summary: the harness sweeper's)
    rather than end the process where it stands (SIGTERM) or with a traceback (SIGINT)."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if runs_in_a_pool(config.hydra.launcher):
            name_sweep_process()
            _arm_workers_at_start(True)
            self._previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._previous:
            _arm_workers_at_start(False)
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}


def _arm_workers_at_start(on: bool) -> None:
    """Make every loky worker of this process's pools die with it from the worker's start
    (`die_with_sweep` as loky's initializer), not from its first job; `on=False` restores
    joblib's own loky backend. Hydra's joblib launcher names the backend "loky" (always)."""
    from joblib import register_parallel_backend  # here: only a pool's sweep has joblib installed
    from joblib.parallel import LokyBackend

    armed = functools.partial(LokyBackend, initializer=die_with_sweep)
    register_parallel_backend("loky", armed if on else LokyBackend)
