"""Fault injection, shipped as config: `fault.kind=K fault.rank=R fault.phase=P` (the config's
side, which faults are accepted, is `launcher.config.fault_config`; this module fires them).

Useful to smoke-test a cluster and the orchestrator itself: each kind must end the run within
the configured timeout, leave no process behind, exit non-zero, and be reported with the rank
and phase (and the traceback or NaN counts).

Rank phases (`launcher.config.rank_phases`): fixture, golden, save (with save_data only), layer,
gather, compare (rank 0 only).

| kind      | what rank R does at the start of phase P                                   |
|-----------|----------------------------------------------------------------------------|
| `raise`   | raises an exception                                                        |
| `exit`    | exits the process at once with status 3 (no Python error report)          |
| `hang`    | sleeps forever (its peers time out in their next collective)               |
| `nan`     | after the layer, puts NaN into its first request's x_out rows (phase layer) |
| `corrupt` | after the layer, silently negates its first request's x_out rows (phase layer) |
"""

from __future__ import annotations

import os
import time

import torch

from launcher.config.fault_config import OUTPUT_KINDS, Fault

EXIT_STATUS = 3


class InjectedFault(RuntimeError):
    """The exception of `fault.kind=raise`."""


def at_phase_start(fault: Fault | None, phase: str, rank: int) -> None:
    """Injects a process fault (raise, exit, hang) when this rank enters the faulty phase."""
    if fault is None or fault.rank != rank or fault.phase != phase:
        return
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault: rank {rank} raises at the start of phase '{phase}'")
    if fault.kind == "exit":
        os._exit(EXIT_STATUS)
    if fault.kind == "hang":
        while True:
            time.sleep(3600)


def on_outputs(fault: Fault | None, rank: int, outputs: dict[str, torch.Tensor], output: str, seq: int) -> None:
    """Injects an output fault (nan, corrupt) into the first `seq` rows of this rank's layer
    output `output`, in place."""
    if fault is None or fault.rank != rank or fault.kind not in OUTPUT_KINDS:
        return
    rows = outputs[output][:seq]
    if fault.kind == "nan":
        rows.fill_(float("nan"))
    else:
        rows.copy_(-rows)
