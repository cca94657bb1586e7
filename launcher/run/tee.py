"""Rank 0's log files on the console while a job runs, line by line, as a launcher tees them.

One thread follows every file (`Tee`): each complete line appended to a file is written to its
stream behind a prefix (`[rank0]:`), in the order the file holds them; a file that does not
exist yet is looked for again at the next poll. The thread waits for the next poll on an
event, not in a sleep, so leaving the `with` block copies whatever is left at once instead of
after up to a poll (torch's `TailLog` sleeps: its stop cost every job of a sweep up to a poll
per file).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TextIO


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
                    if lines:
                        stream.write("".join(f"{self._prefix}{line}\n" for line in lines))
                        stream.flush()
                if last:
                    return
                self._done.wait(self._poll_s)
        finally:
            for f in opened.values():
                f.close()


__all__ = ["Tee"]
