"""Processes that die with their parent: no rank and no forkserver outlives the launcher.

The launcher's ranks are forked by the forkserver, not by the launcher, and every rank holds
the forkserver's "alive" pipe and the resource tracker's pipe open: killed by SIGKILL, the OOM
killer or `Popen.kill()`, the launcher runs no clean-up, and the ranks, the forkserver and the
resource tracker would live on, a hung rank until its deadline and a finished one (blocked in
elastic's wrapper, waiting for a reader) forever, holding the caller's stdout and stderr open.

So each link of the chain launcher -> forkserver -> rank is tied to its parent: on Linux by
`prctl(PR_SET_PDEATHSIG, SIGKILL)`, which the kernel delivers the moment the parent thread
ends, in whatever state the child is (hung, stopped, blocked); elsewhere by a thread that
polls the parent pid. The resource tracker then sees its pipe close and exits by itself.

What a rank starts itself (an implementation's `subprocess.Popen`, a compile-worker pool) is
bound to the rank instead (`guard_process_group`): each rank leads a process group of its own,
in which a guardian process waits for the rank's end, however it comes (a passing run's exit,
a stop, a kill), and then ends the whole group.

Torch-free: the forkserver imports this module first (`launcher.run.forkserver.PRELOAD`), and
arms itself here when the process that starts it asks for it (`PARENT_ENV`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

# Set by the process that starts the forkserver (its pid), read and removed by the forkserver.
PARENT_ENV = "DSV4_TP_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1
_WATCH_S = 0.5


def _set_pdeathsig(sig: int) -> bool:
    """Arm the kernel's parent-death signal; False where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_WATCH_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int | None = None) -> None:
    """Be killed (SIGKILL) when the parent ends.

    `parent_pid`: the process that started this one, where known: if it is no longer the
    parent (it died before this call), die now. A rank passes none: torch's own wrapper armed
    a parent-death SIGINT before any of our code ran, which this replaces by SIGKILL (a hung
    or blocked rank never handles SIGINT).
    """
    expected = os.getppid() if parent_pid is None else parent_pid
    if not _set_pdeathsig(signal.SIGKILL):
        threading.Thread(target=_watch, args=(expected,), name="parent-watch", daemon=True).start()
    if os.getppid() != expected:
        os.kill(os.getpid(), signal.SIGKILL)


# What the kernel sends a rank's guardian when the rank ends (its parent-death signal).
_RANK_ENDED = signal.SIGUSR1


def guard_process_group() -> None:
    """Make this process (a rank) the leader of a process group of its own, with a guardian in
    it that ends the group (SIGKILL, the guardian included) when this process ends: every
    process the rank started and that stayed in its group (children, grandchildren, a pool's
    workers) ends with the rank, not when some later run or a reboot ends it. Linux only (the
    guardian waits for the parent-death signal); elsewhere a no-op.

    The guardian blocks every signal it can, so that only the rank's end (or SIGKILL) ends it:
    a signal sent to the rank's group, by the rank itself or by a person, leaves it in place."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader (started so by an external launcher) leads its own group already
        if os.getpgid(0) != os.getpid():
            return
    rank = os.getpid()
    if os.fork() != 0:
        return
    try:  # the guardian: nothing but signal calls, forked from a rank that may hold locks of other threads
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        if _set_pdeathsig(_RANK_ENDED):
            if os.getppid() == rank:
                signal.sigwait({_RANK_ENDED})
        else:
            while os.getppid() == rank:
                time.sleep(_WATCH_S)
    finally:
        os.killpg(0, signal.SIGKILL)
        os._exit(0)  # not reached: the group's SIGKILL ended this process too


def _arm_forkserver() -> None:
    """In the forkserver, at its first preload import: die with the launcher that started it.
    Without a thread: the server forks every rank, and forking a threaded process is unsafe."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None and _set_pdeathsig(signal.SIGKILL) and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGKILL)


_arm_forkserver()
