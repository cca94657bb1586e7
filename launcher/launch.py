"""Start one worker process per rank with torch.distributed.elastic and collect the outcome.

Thin, as `torch.distributed.run` is: RunSpec -> LaunchConfig -> elastic_launch(rank_main).
Each rank logs to `<output_dir>/logs/<run>/attempt_0/<rank>/{stdout,stderr}.log`; rank 0 is also
teed to the console. A failing rank becomes a `RankFailure` naming the root-cause rank, the
stage it failed in, its message, its traceback and its log folder.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing
import os
import re
import uuid
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from . import devices
from .schema import RunSpec
from .worker import rank_main

# Imported by the forkserver once, so that each rank starts without re-importing torch.
PRELOAD = ["torch", "torch.distributed", "hydra.utils", "launcher.worker", "layers.swa", "layers.csa", "layers.hca"]

_STAGE_NOTE = re.compile(r"rank (\d+) failed in stage '(\w+)' at t=([0-9.]+)")
# A rank whose collective broke because a peer died is a casualty, not the root cause.
_CASUALTY = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|timed out|Timed out|"
                       r"DistBackendError|NCCL communicator was aborted|heartbeat", re.IGNORECASE)


@dataclass
class RankFailure:
    rank: int
    stage: str | None
    message: str
    traceback: str
    exitcode: int
    log_dir: str | None
    other_ranks: list[int] = field(default_factory=list)


@dataclass
class LaunchOutcome:
    result: dict | None  # rank 0's return value when every rank succeeded
    failure: RankFailure | None
    log_dir: str


def _launch_config(spec: RunSpec, log_root: str, run_id: str) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=spec.nproc_per_node,
        run_id=run_id,
        role="rank",
        rdzv_backend="c10d",
        # Port 0: the store binds a free loopback port, so concurrent runs never collide.
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"timeout": int(spec.timeout_s), "join_timeout": int(spec.timeout_s)},
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.05,
        start_method=spec.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_root, redirects=Std.ALL, tee={0: Std.ALL}),
    )


def _rank_log_dir(log_root: str, run_id: str, local_rank: int) -> str | None:
    hits = glob.glob(os.path.join(log_root, f"{run_id}*", "attempt_*", str(local_rank)))
    return sorted(hits)[-1] if hits else None


def _describe(rank: int, f, log_root: str, run_id: str) -> tuple[tuple, RankFailure]:
    msg, tb = f.message, ""
    if isinstance(msg, dict):
        tb = msg.get("extraInfo", {}).get("py_callstack", "")
        msg = msg.get("message", "<no message>")
    m = _STAGE_NOTE.search(tb)
    failure = RankFailure(
        rank=rank,
        stage=m.group(2) if m else None,
        message=str(msg),
        traceback=tb,
        exitcode=f.exitcode,
        log_dir=_rank_log_dir(log_root, run_id, f.local_rank),
    )
    # Root cause first: not a casualty of a peer, then the earliest (sub-second) failure time.
    key = (bool(_CASUALTY.search(str(msg))), float(m.group(3)) if m else float(f.timestamp), rank)
    return key, failure


def _recorded_failures(e: ChildFailedError, log_root: str, run_id: str, nproc: int, rank_base: int) -> dict:
    """The agent's failures plus every rank that left an error file before it was stopped."""
    failures = dict(e.failures)
    for local_rank in range(nproc):
        rank = rank_base + local_rank
        log_dir = _rank_log_dir(log_root, run_id, local_rank)
        error_file = os.path.join(log_dir, "error.json") if log_dir else ""
        if rank not in failures and os.path.isfile(error_file):
            failures[rank] = ProcessFailure(local_rank=local_rank, pid=-1, exitcode=1, error_file=error_file)
    return failures


def _failure(e: ChildFailedError, log_root: str, run_id: str, nproc: int, rank_base: int = 0) -> RankFailure:
    failures = _recorded_failures(e, log_root, run_id, nproc, rank_base)
    ranked = sorted(_describe(r, f, log_root, run_id) for r, f in failures.items())
    root = ranked[0][1]
    root.other_ranks = sorted(f.rank for _, f in ranked[1:])
    return root


def launch(spec: RunSpec) -> LaunchOutcome:
    log_root = os.path.join(spec.output_dir, "logs")
    os.makedirs(log_root, exist_ok=True)
    run_id = f"{spec.case.layer}-tp{spec.case.tp}-{uuid.uuid4().hex[:8]}"
    devices.set_reproducible_cpu_env()  # inherited by the forkserver and every rank
    if spec.start_method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
    # The agent logs every worker failure itself; our report names the root cause instead.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(_launch_config(spec, log_root, run_id), rank_main)(spec)
    except ChildFailedError as e:
        return LaunchOutcome(result=None, failure=_failure(e, log_root, run_id, spec.nproc_per_node), log_dir=log_root)
    return LaunchOutcome(result=results[0], failure=None, log_dir=log_root)
