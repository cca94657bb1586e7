"""Runtime faults and probes: ranks that exit, hang or crash, what `impl=` may name, process
state left to the next job, child processes, Hydra callbacks in the launcher."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from hydra.experimental.callback import Callback

from layers.tp import TorchTP


class ExitOnRank1(TorchTP):
    """Rank 1's implementation calls sys.exit(0) instead of returning its outputs."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            sys.exit(0)
        return super().__call__(ctx, tensors)


class Rank1DiesThenRank0Fails(TorchTP):
    """Rank 1 ends at once; rank 0 takes a moment before it raises an error of its own (a
    peer still writing its report when the first death is seen)."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            os._exit(3)
        time.sleep(0.5)
        raise ValueError("rank 0's own error, reported after its peer died")


class SlowToExitOnRank1(TorchTP):
    """Rank 1 raises; on its way out it closes its connections at once and then takes a second
    to end (a slow teardown), so its peer's collective breaks well before rank 1 has exited."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            import atexit

            atexit.register(lambda: (dist.destroy_process_group(), time.sleep(1.0)))
            raise ValueError("rank 1's own error")
        return super().__call__(ctx, tensors)


def openblas_threads() -> int | None:
    """How many threads numpy's OpenBLAS runs in this process (None: none is loaded)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        libraries = sorted({line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]})
    for path in libraries:
        for symbol in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            get = getattr(ctypes.CDLL(path), symbol, None)
            if get is not None:
                return get()
    return None


def process_state() -> list:
    """Whether the garbage collector is on, how many objects it has frozen, OpenBLAS's threads."""
    import gc

    return [gc.isenabled(), gc.get_freeze_count(), openblas_threads()]


class RecordsProcessState(TorchTP):
    """Not a defect, a probe: writes the rank's `process_state()` to
    `$DSV4_TEST_PROCESS_STATE.rank<r>`, then runs the layer."""

    def __call__(self, ctx, tensors):
        import json

        with open(f"{os.environ['DSV4_TEST_PROCESS_STATE']}.rank{ctx.rank}", "w") as f:
            json.dump(process_state(), f)
        return super().__call__(ctx, tensors)


class RecordsLauncherState(Callback):
    """A Hydra callback, in the launcher: writes its `process_state()` to
    `$DSV4_TEST_PROCESS_STATE.launcher` as the job starts."""

    def on_job_start(self, config, **kwargs):
        import json

        with open(f"{os.environ['DSV4_TEST_PROCESS_STATE']}.launcher", "w") as f:
            json.dump(process_state(), f)


class BusyOnRank0IdleOnRank1(TorchTP):
    """Not a defect, a probe of the stage clocks: before the layer, rank 0 computes for 0.3 s
    of its CPU and rank 1 sleeps 0.3 s."""

    def __call__(self, ctx, tensors):
        start = time.process_time()
        if ctx.rank == 0:
            while time.process_time() - start < 0.3:
                pass
        else:
            time.sleep(0.3)
        return super().__call__(ctx, tensors)


class InterruptOnRank1(TorchTP):
    """Rank 1's implementation raises KeyboardInterrupt itself (no signal was sent)."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            raise KeyboardInterrupt
        return super().__call__(ctx, tensors)


class ExtraCollectiveOnRank1(TorchTP):
    """After a correct layer, rank 1 enters one more collective, which its peers never do."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            dist.all_reduce(torch.zeros(1), group=ctx.group)
        return out


# -- what `impl=` may name (launcher.run.preflight.implementation) ------------------------------------
def torch_tp_function(ctx, tensors):
    """The default implementation as a plain function: `impl=` naming a function runs it per rank."""
    return TorchTP()(ctx, tensors)


def takes_nothing():
    """Not an implementation: it cannot be called as (ctx, tensors)."""


class NotCallable:
    """Not an implementation: its instances cannot be called."""


NOT_AN_IMPLEMENTATION = 3


class CrashOnRank1(TorchTP):
    """Rank 1's process dies in the middle of the layer, as a segfault would end it."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            os._exit(7)
        return super().__call__(ctx, tensors)


class KillJobProcess:
    """Kills the process that runs the job with SIGKILL (a rank's parent is the forkserver,
    whose parent is the job's process)."""

    def __call__(self, ctx, tensors):
        with open(f"/proc/{os.getppid()}/stat") as f:
            job_pid = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(job_pid, signal.SIGKILL)
        time.sleep(60)


# What `ChangesProcessState` leaves behind; `ExpectsFreshProcessState` refuses to run in it.
LEFT_BEHIND_ENV = "DSV4_TEST_LEFT_BY_AN_EARLIER_JOB"
LEFT_BEHIND_SEED = 12345


class ChangesProcessState(TorchTP):
    """Correct outputs, and then process-wide state changed through public APIs, which a warm
    rank must put back before its next job."""

    def __call__(self, ctx, tensors):
        outputs = super().__call__(ctx, tensors)
        os.environ[LEFT_BEHIND_ENV] = "1"
        os.chdir("/")
        torch.manual_seed(LEFT_BEHIND_SEED)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("medium")
        return outputs


class ExpectsFreshProcessState(TorchTP):
    """The default implementation, refusing to run where an earlier job's state is still there."""

    def __call__(self, ctx, tensors):
        left = {"environment": LEFT_BEHIND_ENV in os.environ, "cwd": os.getcwd() == "/",
                "seed": torch.initial_seed() == LEFT_BEHIND_SEED, "dtype": torch.get_default_dtype() != torch.float32,
                "grad mode": not torch.is_grad_enabled(), "determinism": torch.are_deterministic_algorithms_enabled(),
                "matmul precision": torch.get_float32_matmul_precision() != "highest"}
        if any(left.values()):
            raise RuntimeError(f"an earlier job's process state is still here: {[k for k, v in left.items() if v]}")
        return super().__call__(ctx, tensors)


class HoldsTheLauncherAfterItsResult(Callback):
    """A Hydra callback, in the launcher: once the job has written its result, creates
    `$DSV4_TEST_HOLD.held` and waits for `$DSV4_TEST_HOLD.go` (at most 300 s), so that a test
    can start a second launcher while this one still runs."""

    def on_job_end(self, config, job_return, **kwargs):
        base = os.environ["DSV4_TEST_HOLD"]
        open(f"{base}.held", "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{base}.go") and time.monotonic() < deadline:
            time.sleep(0.05)


# The folder where `StartsAChildProcess` records the pid of each child it starts.
CHILD_PIDS_ENV = "DSV4_TEST_CHILD_PIDS"


class StartsAChildProcess(TorchTP):
    """Correct outputs, and a child process on every rank that would run for 1000 s (as a
    compile-worker pool or a helper server started with `subprocess.Popen` would outlive it);
    its pid goes to `$DSV4_TEST_CHILD_PIDS/rank<R>.pid`."""

    def __call__(self, ctx, tensors):
        import subprocess

        child = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL)
        with open(os.path.join(os.environ[CHILD_PIDS_ENV], f"rank{ctx.rank}.pid"), "w") as f:
            f.write(str(child.pid))
        return super().__call__(ctx, tensors)


# A file `KillJobProcessOnceAFileExists` waits for before it kills its job's process.
KILL_AFTER_ENV = "DSV4_TEST_KILL_AFTER"


class KillJobProcessOnceAFileExists(KillJobProcess):
    """`KillJobProcess`, once the file `$DSV4_TEST_KILL_AFTER` exists (another job's progress
    file: that job is running then), or after 120 s without it."""

    def __call__(self, ctx, tensors):
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ[KILL_AFTER_ENV]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().__call__(ctx, tensors)


# -- a defect synchronised on its peers' progress, not on the machine's speed -------------------
class ExtraCollectiveOnceRank0MovedOn(TorchTP):
    """ExtraCollectiveOnRank1, with rank 1 entering its extra collective only once rank 0's
    progress file (`progress`: the run's progress/rank0.jsonl) shows rank 0 in the gather stage:
    however loaded the machine, its peer has moved on when it is left behind."""

    def __init__(self, progress: str):
        self.progress = progress

    def _rank0_gathers(self) -> bool:
        import json  # this section's own: the file above is shared and only grows at its end

        try:
            with open(self.progress) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        # A line still being written is not an event yet.
        return any(line.endswith("}") and json.loads(line)["phase"] == "gather" for line in lines)

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            while not self._rank0_gathers():
                time.sleep(0.01)
            dist.all_reduce(torch.zeros(1), group=ctx.group)
        return out
