"""Claiming a job slot (`launcher.config.job_slot`) among the jobs of a sweep running at once.

Slot k is an exclusive `flock` on `<sweep dir>/.slots/<k>.lock`, held by the job's process
for as long as the job runs. The kernel drops a flock with the last descriptor of the file, so
a slot is free again when its job ends, whatever its outcome: returned, raised, or killed
(a lock file left by a dead process holds no lock). The descriptor is close-on-exec, and the
ranks fork from the forkserver, which was exec'd: no rank holds a slot.

A job tries its own slot first (job number mod slot count), so that which job runs where
follows the sweep's order and not the timing, then every other; when all are held (more
jobs than slots, or two sweeps sharing a folder) it waits for the first to come free.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("launcher.run.slots")

SLOTS_FOLDER = ".slots"
POLL_S = 0.2  # how often a job waiting for a slot looks again


def lock_path(sweep_dir: str, index: int) -> str:
    return os.path.join(sweep_dir, SLOTS_FOLDER, f"{index}.lock")


def _try_lock(path: str) -> int | None:
    """An open descriptor holding the exclusive lock on `path`, or None when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    # Who holds it, for a person reading the folder while the sweep runs.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _first_free(sweep_dir: str, order: list[int]) -> tuple[int, int] | None:
    """(slot index, descriptor holding its lock) of the first free slot in `order`."""
    for index in order:
        fd = _try_lock(lock_path(sweep_dir, index))
        if fd is not None:
            return index, fd
    return None


@contextmanager
def claim(sweep_dir: str, count: int, job_num: int) -> Iterator[int]:
    """Hold a free slot of `count` for the duration of the block; yields its index."""
    os.makedirs(os.path.join(sweep_dir, SLOTS_FOLDER), exist_ok=True)
    preferred = job_num % count
    order = [preferred] + [k for k in range(count) if k != preferred]
    held = _first_free(sweep_dir, order)
    if held is None:
        log.info("job %d waits for one of %d job slots in %s", job_num, count, sweep_dir)
    while held is None:
        time.sleep(POLL_S)
        held = _first_free(sweep_dir, order)
    index, fd = held
    try:
        yield index
    finally:
        os.close(fd)  # releases the lock
