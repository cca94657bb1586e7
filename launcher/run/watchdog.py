"""The launcher's own wall-clock watch over this node's ranks: a frozen rank never hangs a run.

A rank's own deadline (`faulthandler`, 2 x timeout_s) is a thread of that rank: a rank stopped
by SIGSTOP (a debugger, a frozen cgroup) is frozen with it, and at tp=1 no peer times out
either, so the launcher would wait forever. With peers, they time out, and every other rank is
asked to stop with SIGTERM, which a stopped rank cannot handle (across nodes the elastic agent
then waits 30 s more before its SIGKILL).

Each rank writes its pid file as it starts (`write_pid_file`); `RankWatchdog` reads them from a
thread of the launcher while the ranks run, and
* kills a rank that is stopped (process state T or t, in two polls running) once a peer has
  ended (or finished the job, `finished`: a warm rank stays alive): it can never finish, and
  its peers' failure is its doing;
* kills every rank still there at the launcher's deadline: a rank's own deadline plus a grace
  that lets a rank's own stack dump (more telling) come first.
Each kill is recorded in `killed` (rank -> why) for the failure report. Process states come
from /proc (Linux); elsewhere only the deadline applies.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

POLL_S = 0.5
STOPPED = ("T", "t")  # stopped by a signal, stopped by a tracer


def pid_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, "progress", f"rank{rank}.pid")


def _proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat from the state on (field 3); None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def write_pid_file(output_dir: str, rank: int) -> None:
    """A rank's first act: tell the launcher's watchdog who it is and when it started."""
    stat = _proc_stat("self")
    record = {"pid": os.getpid(), "t": time.time(), "starttime": int(stat[19]) if stat else None}
    path = pid_path(output_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(record, f)
    os.replace(f"{path}.tmp", path)


def grace_s(deadline_s: float) -> float:
    """How long after a rank's own deadline the launcher's comes."""
    return max(5.0, 0.1 * deadline_s)


class RankWatchdog:
    """Watches ranks `ranks` of a run writing into `output_dir` (a context manager)."""

    def __init__(self, output_dir: str, ranks, deadline_s: float, poll_s: float = POLL_S):
        self.output_dir = output_dir
        self.ranks = list(ranks)
        self.deadline_s = deadline_s + grace_s(deadline_s)
        self.poll_s = poll_s
        self.killed: dict[int, str] = {}
        self._records: dict[int, dict] = {}
        self._finished: set[int] = set()
        self._stopped_before: set[int] = set()
        self._has_proc = os.path.isdir("/proc")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RankWatchdog:
        self._thread = threading.Thread(target=self._loop, name="rank-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def finished(self, rank: int) -> None:
        """`rank` has finished the job and waits, alive, for the next (a warm rank): it has
        ended as far as the job is concerned."""
        self._finished.add(rank)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def _read_pid_files(self) -> None:
        for rank in self.ranks:
            if rank not in self._records:
                try:
                    with open(pid_path(self.output_dir, rank)) as f:
                        self._records[rank] = json.load(f)
                except (OSError, ValueError):
                    continue

    def _state(self, rank: int) -> str | None:
        """The rank's process state letter; None once it is gone; '?' where /proc cannot tell."""
        record = self._records[rank]
        if not self._has_proc:
            try:
                os.kill(record["pid"], 0)
            except ProcessLookupError:
                return None
            return "?"
        stat = _proc_stat(record["pid"])
        if stat is None or (record["starttime"] is not None and int(stat[19]) != record["starttime"]):
            return None  # gone (its pid may be another process's by now)
        return None if stat[0] in ("Z", "X") else stat[0]

    def poll(self) -> None:
        self._read_pid_files()
        states = {rank: self._state(rank) for rank in self._records if rank not in self.killed and rank not in self._finished}
        a_peer_ended = any(s is None for s in states.values()) or bool(self.killed) or bool(self._finished)
        stopped = {rank for rank, s in states.items() if s in STOPPED}
        now = time.time()
        for rank, state in states.items():
            if state is None:
                continue
            frozen = "frozen (process state T: stopped by a signal such as SIGSTOP, or by a debugger)"
            if rank in stopped and rank in self._stopped_before and a_peer_ended:
                self._kill(rank, f"rank {rank} was {frozen} after its peers had ended; the launcher killed it")
            elif now - self._records[rank]["t"] > self.deadline_s:
                what = frozen if rank in stopped else "still running"
                self._kill(rank, f"rank {rank} was {what} {self.deadline_s:.0f} s after it started, past its own "
                                 f"deadline (2 x timeout_s); the launcher killed it")
        self._stopped_before = stopped

    def _kill(self, rank: int, why: str) -> None:
        try:
            os.kill(self._records[rank]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed[rank] = why
