"""Output folders of runs and sweeps: every launcher gets a folder of its own.

Hydra names a run's folder by the second it started (`outputs/<date>/<time>`): two launchers
started in the same folder in the same second would share it, one result.json overwriting the
other and one run's progress files deleted by the other. `${fresh_dir:BASE}` (configs/config.yaml
names the run and sweep folders with it) claims BASE, or BASE-1, BASE-2, ... : the first that
does not exist yet, created at once (`os.mkdir` is atomic, so two claims never get the same one).

Resolved once per process (OmegaConf's resolver cache, which Hydra copies to every job of a
sweep); a folder that cannot be created is a ConfigError naming it and why.

A folder named explicitly (`hydra.run.dir=out`) is not made fresh: two launchers given the
same one would write over each other, the later result winning. `claim` holds the folder for
the launcher's lifetime (an exclusive `flock` of its `.launcher.lock`, which the kernel
releases when the process ends, however it ends); a second launcher given a folder another
one holds is refused before it writes anything there. A folder reused after its launcher
ended is the user's to reuse.
"""

from __future__ import annotations

import fcntl
import itertools
import os

from layers.contract.config import ConfigError


def fresh_dir(base: str) -> str:
    """Claim `base` or the first free `base-N`, creating it; the path claimed."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
        for path in itertools.chain([base], (f"{base}-{n}" for n in itertools.count(1))):
            try:
                os.mkdir(path)
                return path
            except FileExistsError:
                continue
    except OSError as e:
        why = "not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise ConfigError(f"output folder {base} cannot be created ({e.filename}: {why}); "
                          f"set hydra.run.dir (or hydra.sweep.dir) to a writable folder") from e


LOCK = ".launcher.lock"


def claim(path: str) -> None:
    """Hold `path` (created if need be) for this process; a ConfigError when another live
    launcher holds it. The lock file names the process that holds it (its pid): a second
    claim by the same process is kept, with nothing to remember in this one."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)  # the lock is the first descriptor's (flock's is per open file), held on
        if holder == str(os.getpid()):
            return
        raise ConfigError(f"output folder {path} is in use by another launcher, which would write over this "
                          f"one's results or this one over its: give each launcher (each node of a multi-node "
                          f"run) a folder of its own") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    # `fd` stays open, never closed: the lock lasts as long as this process.
