"""What every rank process is born with: the CPU environment and a forkserver with torch imported.

Torch-free on purpose: `python -m launcher` starts the forkserver before it imports anything
heavy, so the server's imports (torch, the layers) run on a second core while the launcher
imports Hydra and torch.distributed.elastic; each rank then forks from a warm server.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import tempfile
import threading

from launcher.run import lifeline

# Imported by the forkserver once, so that each rank starts without re-importing torch; the
# first pauses the garbage collector for the imports, the second arms the server to die with
# the launcher, the last works out what every rank needs and resumes the collector.
PRELOAD = ["launcher.run.import_gc", "launcher.run.lifeline", "torch", "torch.distributed", "hydra.utils", "launcher.run.worker", "launcher.run.rank_server", "layers.registry", "layers.tp",
           "layers.stages", "launcher.run.bisect", "launcher.run.rank_preload"]

# The CPU environment of every harness process, set before torch is imported (a value the
# user set wins).
CPU_ENV = {
    # MKL picks its fp32 GEMM kernels by CPU feature and may reorder sums between runs and
    # machines; the reference snapshots were made with the AVX2 code path in strict
    # (run-to-run reproducible) mode. MKL reads this once, at its first GEMM, so it must be in
    # the environment before any rank (or the pytest process) multiplies anything.
    "MKL_CBWR": "AVX2,STRICT",
    # numpy, which torch imports, starts OpenBLAS with a thread per core, and each spins for
    # about 0.1 s waiting for work that never comes: nothing here multiplies with numpy.
    "OPENBLAS_NUM_THREADS": "1",
}


def set_cpu_env() -> None:
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)


def use_standard_start_method(start_method: str) -> None:
    """Make `start_method` this process's default where the default is not one of the standard
    library's. A rank (and the forkserver) is told its parent's default start method and
    must find it: a job run inside a worker of joblib's loky (`hydra/launcher=joblib`) has
    loky's as its default, which a plain child process does not know."""
    if multiprocessing.get_start_method(allow_none=True) not in (None, *multiprocessing.get_all_start_methods()):
        multiprocessing.set_start_method(start_method, force=True)


# The forkserver listens on an AF_UNIX socket at <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX,
# and such a path holds at most 107 bytes; cluster jobs often get a long TMPDIR.
_SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX_LEN = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def _fit_socket_path() -> None:
    """Put this process's temp files under /tmp when the forkserver's socket would not fit
    under the temp dir it was given, rather than fail to start any rank."""
    if len(tempfile.gettempdir()) + _SOCKET_SUFFIX_LEN > _SOCKET_PATH_MAX and os.access("/tmp", os.W_OK):
        tempfile.tempdir = "/tmp"


def start() -> None:
    """Start the forkserver (once per process; later calls find it running). The environment
    is set first: the server, and every rank forked from it, inherit it as it is now.

    The server dies with this process (`launcher.run.lifeline`) when the main thread starts
    it: the kernel's parent-death signal follows the thread that forked, and a worker
    thread's end would take a server that later runs still need with it."""
    use_standard_start_method("forkserver")
    _fit_socket_path()
    set_cpu_env()
    multiprocessing.set_forkserver_preload(PRELOAD)
    if threading.current_thread() is threading.main_thread():
        os.environ[lifeline.PARENT_ENV] = str(os.getpid())
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(lifeline.PARENT_ENV, None)
