"""Rank 0's log files on the console while a job runs, line by line, as a launcher tees them.

One thread follows every file (`Tee`): each complete line appended to a file is written to its
stream behind a prefix (`[rank0]:`), in the order the file holds them; a file that does not
exist yet is looked for again at the next poll. The thread waits for the next poll on an
event, not in a sleep, so leaving the `with` block copies whatever is left at once instead of
after up to a poll (torch's `TailLog` sleeps: its stop cost every job of a sweep up to a poll
per file).

Rank 0's own log records at INFO and below (`HH:MM:SS rank0 INFO phase layer done`) stay in its
log files: the progress display already says each stage once. `-v` on the command line
(`show_log_records`) copies them too; warnings, errors and whatever the implementation prints
always reach the console. On a terminal each copied line first clears the line it lands on:
the progress display's status line (`launcher.report.progress`) would otherwise show through.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import TextIO


# A rank's log record at INFO or DEBUG, as `launcher.run.worker` formats them.
_QUIET_RECORD = re.compile(r"^\d\d:\d\d:\d\d rank\d+ (INFO|DEBUG) ")
_CLEAR_LINE = "\r\x1b[2K"
_show_records = False


def show_log_records(show: bool = True) -> None:
    """Copy the ranks' INFO records to the console too (`python -m launcher -v`)."""
    global _show_records
    _show_records = show


def log_records_shown() -> bool:
    return _show_records


def quiet_record(line: str) -> bool:
    """A rank's own log record at INFO or DEBUG."""
    return _QUIET_RECORD.match(line) is not None


def shown(line: str) -> bool:
    """Whether a line of rank 0's logs reaches the console (see the module)."""
    return _show_records or not quiet_record(line)


class Tee:
    """`with Tee([(path, stream), ...], prefix, poll_s):` copies the files' new lines to their
    streams until the block ends, then the rest (a last line without its newline included)."""

    def __init__(self, files: Sequence[tuple[str, TextIO]], prefix: str, poll_s: float):
        self._files = list(files)
        self._prefix = prefix
        self._poll_s = poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="rank0-tee", daemon=True)

    def __enter__(self) -> Tee:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _follow(self) -> None:
        opened: dict[str, TextIO] = {}
        partial = {path: "" for path, _ in self._files}  # a line still being written
        try:
            while True:
                last = self._done.is_set()  # what was written before the block ended is copied below
                for path, stream in self._files:
                    if path not in opened:
                        if not os.path.exists(path):
                            continue
                        opened[path] = open(path, errors="replace", newline="")  # lines end at "\n" alone
                    *lines, partial[path] = (partial[path] + opened[path].read()).split("\n")
                    if last and partial[path]:
                        lines.append(partial[path])
                    lines = [line for line in lines if shown(line)]
                    if lines:
                        isatty = getattr(stream, "isatty", None)
                        clear = _CLEAR_LINE if isatty is not None and isatty() else ""
                        stream.write(clear + "".join(f"{self._prefix}{line}\n" for line in lines))
                        stream.flush()
                if last:
                    return
                self._done.wait(self._poll_s)
        finally:
            for f in opened.values():
                f.close()


__all__ = ["Tee", "show_log_records", "log_records_shown", "shown", "quiet_record"]
