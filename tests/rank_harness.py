"""Real gloo ranks for the scope and bisect tests, and the worker's per-rank flow for a scope.

`run_ranks(world, job, *args)` forks `world` processes on a free 127.0.0.1 port, calls
`job(rank, world, *args)` in each with the default process group up, and returns every rank's
result (fork keeps torch imported, so a tp = 8 run starts in about a second on 2 cores).

`run_scope(case, scope, impl)` runs a scope through the real launcher (`scope=` key) and returns
rank 0's verdicts by tensor.
"""

from __future__ import annotations

import datetime
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.pytest_plugin import run_layer
from launcher.run.rank_group import GroupPool

# This test process's warm rank groups: a scope run of an earlier case's shape reuses its ranks.
WARM_RANKS = GroupPool()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, job, args) -> None:
    torch.set_num_threads(1)  # the ranks share 2 cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        torch.save(job(rank, world, *args), Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, job, *args) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world, _free_port(), out_dir, job, args), nprocs=world, join=True,
                           start_method="fork")
        return [torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world)]


def run_scope(case, scope: str, impl=None) -> dict:
    """Verdicts by tensor of `scope` of `case`, run by the real launcher on `case.tp` ranks
    (`impl` None: the project's implementation; else a function `impl(ctx, tensors)`)."""
    keys = dict(layer=case.layer, model=case.model.name, tp=case.tp, local_t=case.local_t, seed=case.seed,
                scope=scope, golden_cache=None)
    if impl is not None:
        keys["impl"] = impl
    with tempfile.TemporaryDirectory() as out_dir:
        run = run_layer(out_dir, pool=WARM_RANKS, **keys)
    assert run.result and run.result["status"] == "ok", run
    return {v["tensor"]: v for v in run.result["verdicts"]}


__all__ = ["run_ranks", "run_scope"]
