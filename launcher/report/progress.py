"""Progress on long work: sweep jobs done/total and the rank phases of the run in flight.

Owns the console side only; the events come from elsewhere. Each rank appends its phase
events (`{rank, phase, event: start|done|failed, t}`, one JSON object a line) to
`<output_dir>/progress/rank<r>.jsonl` (`launcher.run.worker.progress_path`); `PhaseWatcher` polls
those files from a thread of the launcher process while the ranks run. The sweep callback
(`launcher.report.sweep_summary`) reports jobs as they start and end through the same `Display`.

On a terminal the run in flight is one status line, rewritten in place; everywhere else
(a pipe, a CI log, a file) every change is a plain line of its own, so the output has no
control characters but the newline. Progress goes to stderr; stdout keeps the reports.
"""

from __future__ import annotations

import glob
import io
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

from launcher.config.rank_phases import RANK_PHASES

POLL_S = 0.2
_CLEAR_LINE = "\r\x1b[2K"


class Display:
    """Writes progress to a stream: a rewritten status line on a TTY, plain lines elsewhere."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self._stream = stream
        self._tty = tty
        self._status_shown = False
        self._lock = threading.Lock()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def tty(self) -> bool:
        if self._tty is not None:
            return self._tty
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def line(self, text: str) -> None:
        """A line that stays (a job started or ended, a phase finished on every rank)."""
        with self._lock:
            if self._status_shown:
                self.stream.write(_CLEAR_LINE)
                self._status_shown = False
            self.stream.write(text + "\n")
            self.stream.flush()

    def status(self, text: str) -> None:
        """The state of the work in flight: rewritten in place on a TTY, dropped elsewhere
        (the plain-line display reports the same changes through `line`)."""
        if not self.tty:
            return
        # Cut to the terminal's width: a longer line wraps, and "\r" then rewrites only its tail.
        text = text[: max(1, self.columns() - 1)]
        with self._lock:
            # The cursor goes back to column 0: a line someone else writes (rank 0's teed log)
            # then starts at the left margin instead of after the status text.
            self.stream.write(_CLEAR_LINE + text + "\r")
            self.stream.flush()
            self._status_shown = True

    def columns(self) -> int:
        """The terminal's width: $COLUMNS where set (as the shell and shutil read it), else the
        stream's terminal, else 80."""
        try:
            return int(os.environ["COLUMNS"])
        except (KeyError, ValueError):
            pass
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return 80

    def clear(self) -> None:
        with self._lock:
            if self._status_shown:
                self.stream.write(_CLEAR_LINE)
                self.stream.flush()
                self._status_shown = False


# -- Hydra's composition: its errors become one line ---------------------------------------------

_held_stderr: io.StringIO | None = None  # what Hydra wrote to stderr while composing


def hold_stderr_while_composing() -> None:
    """Keep what Hydra writes to stderr until the config is composed: a composition error is
    then shown as one line (`composition_error`), and warnings pass on (`composition_done`)."""
    global _held_stderr
    _held_stderr = io.StringIO()
    sys.stderr = _held_stderr


def composition_done() -> None:
    """The config is composed (a run or multirun starts): stderr is the terminal's again, and
    what was held is written to it."""
    global _held_stderr
    if _held_stderr is not None:
        held, _held_stderr = _held_stderr, None
        sys.stderr = sys.__stderr__
        sys.stderr.write(held.getvalue())


def composition_error() -> str | None:
    """What Hydra wrote if it stopped while composing (None once the config was composed)."""
    global _held_stderr
    if _held_stderr is None:
        return None
    held, _held_stderr = _held_stderr, None
    sys.stderr = sys.__stderr__
    return held.getvalue()


@dataclass
class SweepCounter:
    """Jobs of the multirun in flight, as the sweep callback counts them."""

    total: int
    done: int = 0
    failed: int = 0
    current: int | None = None  # the number of the job in flight, from 1

    def prefix(self) -> str:
        return f"[{self.current}/{self.total}] " if self.current is not None else ""


@dataclass
class _Phase:
    started: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    first_t: float | None = None
    last_t: float | None = None


def _phase_key(name: str) -> tuple[int, str]:
    """Phases in the order a rank runs them; a name not in the list sorts after them."""
    return (RANK_PHASES.index(name) if name in RANK_PHASES else len(RANK_PHASES), name)


class PhaseWatcher:
    """Follows the ranks' phase events of one run while it runs (a context manager).

    `expected_ranks` is the run's number of ranks: a phase counts as finished when every rank
    reported it done.
    """

    def __init__(self, output_dir: str, expected_ranks: int, label: str, display: Display | None = None,
                 poll_s: float = POLL_S, prefix: str = ""):
        self.dir = os.path.join(output_dir, "progress")
        self.ranks = expected_ranks
        self.label = label
        self.display = display if display is not None else Display()
        self.prefix = prefix  # a sweep job's "[3/12] "
        self.poll_s = poll_s
        self.phases: dict[str, _Phase] = {}
        self._offsets: dict[str, int] = {}
        self._reported: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.time()

    def __enter__(self) -> PhaseWatcher:
        self._t0 = time.time()
        self._thread = threading.Thread(target=self._loop, name="phase-watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()  # events written just before the ranks exited
        self.display.clear()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def _read_events(self) -> list[dict]:
        events = []
        for path in sorted(glob.glob(os.path.join(self.dir, "rank*.jsonl"))):
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
            # A line still being written has no newline yet: leave it for the next poll.
            complete = chunk[: chunk.rfind("\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete.encode())
            events += [json.loads(ln) for ln in complete.splitlines() if ln.strip()]
        return events

    def poll(self) -> None:
        """Read new events, report what changed."""
        for ev in self._read_events():
            st = self.phases.setdefault(ev["phase"], _Phase())
            rank, t = int(ev["rank"]), float(ev["t"])
            {"start": st.started, "done": st.done, "failed": st.failed}[ev["event"]].add(rank)
            st.first_t = t if st.first_t is None else min(st.first_t, t)
            st.last_t = t if st.last_t is None else max(st.last_t, t)
        for name in sorted(self.phases, key=_phase_key):
            st = self.phases[name]
            if len(st.done) >= self.ranks and (name, "done") not in self._reported:
                self._reported.add((name, "done"))
                span = (st.last_t or 0.0) - (st.first_t or 0.0)
                self.display.line(f"{self.prefix}{self.label}: {name} done on {len(st.done)}/{self.ranks} "
                                  f"rank{'s' if self.ranks > 1 else ''} ({span:.2f}s)")
            for rank in sorted(st.failed):
                if (name, f"failed{rank}") not in self._reported:
                    self._reported.add((name, f"failed{rank}"))
                    self.display.line(f"{self.prefix}{self.label}: rank {rank} failed in phase {name}")
        self.display.status(self.status_text())

    def status_text(self) -> str:
        cells = []
        for name in sorted(self.phases, key=_phase_key):
            st = self.phases[name]
            mark = " FAILED" if st.failed else ""
            cells.append(f"{name} {len(st.done)}/{self.ranks}{mark}")
        return f"{self.prefix}{self.label}  " + "  ".join(cells) + f"  {time.time() - self._t0:.1f}s"
