"""Job slots: how jobs running at once on one node share its cores and devices.

A parallel Hydra launcher (joblib, `hydra.launcher.n_jobs` > 1) runs several jobs of a sweep
at once on this node. Each running job holds one slot (claimed by `launcher.run.slots`), and
slot k of S owns the k-th of S equal slices of the usable cores and of the node's devices:
64 cores, 8 GPUs and S = 4 give every job 16 cores and 2 GPUs. Equal slices, so that a job's
threads and devices (and with them its verdict) never depend on which slot it drew; the
remainder of an uneven division is left unused. Every other launcher runs one job at a time
on a node (basic) or one per node (Slurm): S = 1, no slot, the job keeps the whole node.

Pure rules, no file locks and no device probing: the caller passes what the node has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

JOBLIB_LAUNCHER = "JoblibLauncher"  # the class name ending hydra.launcher._target_


@dataclass(frozen=True)
class JobSlot:
    """The share of the node that one concurrently running job owns; its ranks run there."""

    index: int
    count: int
    cpus: tuple[int, ...]  # the cores every rank of the job may run on (sched_setaffinity)
    devices: Optional[tuple[str, ...]] = None  # the accelerators' ids, as the visibility variable names them
    device_env: Optional[str] = None  # CUDA_VISIBLE_DEVICES or ASCEND_RT_VISIBLE_DEVICES

    def describe(self) -> str:
        devices = f", {self.device_env}={','.join(self.devices)}" if self.devices is not None else ""
        return f"job slot {self.index} of {self.count}: cores {','.join(map(str, self.cpus))}{devices}"


def runs_in_a_pool(launcher: dict) -> bool:
    """Whether the Hydra launcher runs the sweep's jobs in a pool of worker processes, each
    worker taking job after job (joblib's loky)."""
    return str(launcher.get("_target_", "")).endswith(JOBLIB_LAUNCHER)


def slot_count(launcher: dict, planned_jobs: Optional[int], n_cpus: int, n_devices: Optional[int]) -> int:
    """How many jobs of this sweep may run at once on this node, each in a slot of its own.

    `launcher`: the composed `hydra.launcher` node; `planned_jobs`: the sweep's job count
    (None when its sweeper does not say); `n_devices`: the node's accelerators (None: none).
    joblib runs `n_jobs` at once (a negative n_jobs counts back from the cores, as joblib
    does: -1 is all of them), never more than the sweep has jobs; a slot needs at least one
    core and one device, so more jobs than that wait for a free slot."""
    if not runs_in_a_pool(launcher):
        return 1
    n_jobs = launcher.get("n_jobs")
    n_jobs = 1 if n_jobs is None else int(n_jobs)
    if n_jobs < 0:
        n_jobs = n_cpus + 1 + n_jobs
    limits = [n_jobs, n_cpus] + [n for n in (planned_jobs, n_devices) if n is not None]
    return max(1, min(limits))


def job_slot(index: int, count: int, cpus: list[int], devices: Optional[list[str]] = None,
             device_env: Optional[str] = None) -> JobSlot:
    """Slot `index` of `count`: its equal slice of the usable `cpus` and of the node's `devices`."""
    assert 0 <= index < count <= len(cpus), (index, count, len(cpus))
    per_cpu = len(cpus) // count
    cpu_slice = tuple(sorted(cpus)[index * per_cpu:(index + 1) * per_cpu])
    device_slice = None
    if devices is not None:
        per_device = len(devices) // count
        device_slice = tuple(devices[index * per_device:(index + 1) * per_device])
    return JobSlot(index=index, count=count, cpus=cpu_slice, devices=device_slice,
                   device_env=device_env if devices is not None else None)
