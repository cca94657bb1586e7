"""Fault injection, shipped as config: `fault.kind=K fault.rank=R fault.stage=S`.

Useful to smoke-test a cluster and the orchestrator itself: each kind must end the run within
the configured timeout, leave no process behind, exit non-zero, and be reported with the rank
and stage (and the traceback or NaN counts).

Stages: fixture, golden, save (with save_data only), layer, gather, compare (rank 0 only).

| kind      | what rank R does at the start of stage S                                   |
|-----------|----------------------------------------------------------------------------|
| `raise`   | raises an exception                                                        |
| `exit`    | exits the process at once with status 3 (no Python error report)          |
| `hang`    | sleeps forever (its peers time out in their next collective)               |
| `nan`     | after the layer, puts NaN into its first request's x_out rows (stage layer) |
| `corrupt` | after the layer, silently negates its first request's x_out rows (stage layer) |
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from layers.contract.config import ConfigError

KINDS = ("raise", "exit", "hang", "nan", "corrupt")
STAGES = ("fixture", "golden", "save", "layer", "gather", "compare")
OUTPUT_KINDS = ("nan", "corrupt")  # faults in the implementation's outputs, not in the process
EXIT_STATUS = 3


class InjectedFault(RuntimeError):
    """The exception of `fault.kind=raise`."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    stage: str

    def check(self, tp: int, saves: bool) -> None:
        """Refuse a fault that could never fire: a smoke test expecting it must not pass silently.
        `saves`: the run writes a snapshot (the only runs with a 'save' stage)."""
        if self.kind not in KINDS:
            raise ConfigError(f"fault.kind={self.kind!r} must be one of {', '.join(KINDS)}")
        if self.stage not in STAGES:
            raise ConfigError(f"fault.stage={self.stage!r} must be one of {', '.join(STAGES)}")
        if not 0 <= self.rank < tp:
            raise ConfigError(f"fault.rank={self.rank} must be in [0, {tp}) for tp={tp}")
        if self.kind in OUTPUT_KINDS and self.stage != "layer":
            raise ConfigError(f"fault.kind={self.kind} corrupts the layer's outputs: it needs fault.stage=layer")
        if self.stage == "save" and not saves:
            raise ConfigError("fault.stage=save never runs without save_data=DIR")
        if self.stage == "compare" and self.rank != 0:
            raise ConfigError(f"fault.stage=compare runs on rank 0 alone, not on fault.rank={self.rank}")


def check_unset(rank: int, stage: str, tp: int) -> None:
    """Without fault.kind nothing fires, but the rank and stage must still exist: a sweep over
    `fault.kind=null,hang fault.rank=1` runs both, and a typo must not pass silently."""
    if stage not in STAGES:
        raise ConfigError(f"fault.stage={stage!r} must be one of {', '.join(STAGES)}")
    if not 0 <= rank < tp:
        raise ConfigError(f"fault.rank={rank} must be in [0, {tp}) for tp={tp}")


def at_stage_start(fault: Fault | None, stage: str, rank: int) -> None:
    """Injects a process fault (raise, exit, hang) when this rank enters the faulty stage."""
    if fault is None or fault.rank != rank or fault.stage != stage:
        return
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault: rank {rank} raises at the start of stage '{stage}'")
    if fault.kind == "exit":
        os._exit(EXIT_STATUS)
    if fault.kind == "hang":
        while True:
            time.sleep(3600)


def on_outputs(fault: Fault | None, rank: int, outputs: dict[str, torch.Tensor], seq: int) -> None:
    """Injects an output fault (nan, corrupt) into this rank's x_out, in place."""
    if fault is None or fault.rank != rank or fault.kind not in OUTPUT_KINDS:
        return
    rows = outputs["x_out"][:seq]
    if fault.kind == "nan":
        rows.fill_(float("nan"))
    else:
        rows.copy_(-rows)
