"""A tiny tmpfs for tests of a full or read-only disk: mounted for the test, unmounted after.

Mounting needs root (or CAP_SYS_ADMIN): where it is refused, the test is skipped and says why.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "64k", read_only: bool = False, fill: bool = False):
    """`path` as a tmpfs of `size`; `fill`: filled to the last byte; `read_only`: remounted
    read-only (after `fill`)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (needs root): {mounted.stderr.strip()}")
    try:
        if fill:
            with open(path / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(bytes(512))
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
