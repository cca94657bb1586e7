"""What every rank process is born with: the CPU environment and a forkserver with torch imported.

Torch-free on purpose: `python -m launcher` starts the forkserver before it imports anything
heavy, so the server's imports (torch, the layers) run on a second core while the launcher
imports Hydra and torch.distributed.elastic; each rank then forks from a warm server.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

# Imported by the forkserver once, so that each rank starts without re-importing torch.
PRELOAD = ["torch", "torch.distributed", "hydra.utils", "launcher.worker", "layers.swa", "layers.csa", "layers.hca",
           "layers.scopes", "layers.stages", "launcher.bisect"]

# MKL picks its fp32 GEMM kernels by CPU feature and may reorder sums between runs and
# machines; the reference snapshots were made with the AVX2 code path in strict
# (run-to-run reproducible) mode. MKL reads this once, at its first GEMM, so it must be in the
# environment before any rank (or the pytest process) multiplies anything.
CPU_REPRODUCIBLE_ENV = {"MKL_CBWR": "AVX2,STRICT"}


def set_reproducible_cpu_env() -> None:
    for key, value in CPU_REPRODUCIBLE_ENV.items():
        os.environ.setdefault(key, value)


def start() -> None:
    """Start the forkserver (once per process; later calls find it running). The environment
    is set first: the server, and every rank forked from it, inherit it as it is now."""
    set_reproducible_cpu_env()
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
