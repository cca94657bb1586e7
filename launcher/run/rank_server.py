"""A rank process that takes job after job (the rank side of `launcher.run.rank_group`).

It joins the world once, with the first job, and then runs each job the launcher sends over
its pipe exactly as a rank of a fresh process would (`worker.begin_job`, `worker.run_job`):
its stdout and stderr go to the job's own log folder, a failure is written to the job's
`error.json` in the elastic agent's format, and a job that raises ends the process, so that
its peers' collectives break at once, as a fresh rank's would, and the launcher sees it die.
With each result goes what the job left replaced of the functions the golden runs
(`golden_guard.changes()`: a patch the job's own checks could not see, made by something of
the implementation that ran after them), so that the launcher ends the group.

Between jobs the process-wide state an implementation can change through documented APIs is
put back as it was before the first job ran (`ProcessState`): the environment, the working
folder, the random generators, torch's default dtype, grad mode, threads, determinism and
fp32 matmul settings. The launcher also discards the whole group after any job that did not
pass, so nothing of a failing or defective job reaches the next one.
"""

from __future__ import annotations

import os
import random
import sys
import traceback
from dataclasses import dataclass

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from launcher.run import devices, golden_guard, impl_contract, lifeline, worker

# The elastic agent's variable naming a rank's error file, which `ErrorHandler` writes.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclass
class ProcessState:
    """What a job may change in its process that a later job would otherwise inherit."""

    environ: dict
    cwd: str
    torch_rng: torch.Tensor
    cuda_rng: list | None
    python_rng: object
    default_dtype: torch.dtype
    grad_enabled: bool
    threads: int
    deterministic: tuple[bool, bool]
    matmul_precision: str
    tf32: tuple[bool, bool] | None

    @classmethod
    def capture(cls) -> ProcessState:
        cuda = torch.cuda.is_initialized()
        return cls(environ=dict(os.environ), cwd=os.getcwd(), torch_rng=torch.get_rng_state(),
                   cuda_rng=torch.cuda.get_rng_state_all() if cuda else None, python_rng=random.getstate(),
                   default_dtype=torch.get_default_dtype(), grad_enabled=torch.is_grad_enabled(),
                   threads=torch.get_num_threads(),
                   deterministic=(torch.are_deterministic_algorithms_enabled(),
                                  torch.is_deterministic_algorithms_warn_only_enabled()),
                   matmul_precision=torch.get_float32_matmul_precision(),
                   tf32=(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) if cuda else None)

    def restore(self) -> None:
        """Put back what differs (some setters are slow the first time: the determinism one
        imports much of torch)."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        try:
            os.chdir(self.cwd)
        except OSError:  # the folder is gone: the harness's own paths are absolute
            pass
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.python_rng)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.set_float32_matmul_precision(self.matmul_precision)
        if self.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.tf32


def _write_to(log_dir: str) -> None:
    """Point this process's stdout and stderr (the file descriptors, so that C code and
    faulthandler follow) at the job's log files."""
    os.makedirs(log_dir, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        target = os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def serve(local_rank: int, env: dict[str, str], conn) -> None:
    """The process's life: jobs `(spec, log_dir)` from `conn` until None (exit) or until the
    launcher is gone; each job's result goes back over `conn`."""
    lifeline.die_with_parent()
    lifeline.guard_process_group()
    golden_guard.record()  # a spawned rank's own; a forked one inherited its parent's
    os.environ.update(env)
    device, baseline = None, None
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the launcher is gone
            os._exit(0)
        if job is None:
            break
        spec, log_dir = job
        if baseline is not None:
            baseline.restore()
        _write_to(log_dir)
        os.environ[ERROR_FILE_ENV] = os.path.join(log_dir, "error.json")
        try:
            if device is None:
                devices.enter_job_slot(spec.slot)  # before anything counts the cores or devices
                impl_contract.note_sigint()
            worker.begin_job(spec)
            if device is None:
                device = worker.join_world(spec, local_rank)
                baseline = ProcessState.capture()
                baseline.environ.pop(ERROR_FILE_ENV, None)
            result = worker.run_job(spec, device)
        except BaseException as e:  # recorded, then the process ends: its peers see it go
            ErrorHandler().record_exception(e)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send((result, golden_guard.changes()))
        del result
        worker.release_freed_memory()  # an idle rank holds what it keeps, not what it freed
    # Every rank of the group is told at once, idle, its last job's logs flushed and result
    # sent: nothing is left to do. Leaving the process group first would only wait (gloo's
    # shutdown takes the ranks 10 to 80 ms one after another).
    os._exit(0)
