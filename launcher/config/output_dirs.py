"""Output folders of runs and sweeps: every launcher gets a folder of its own.

Hydra names a run's folder by the second it started (`outputs/<date>/<time>`): two launchers
started in the same folder in the same second would share it, one result.json overwriting the
other and one run's progress files deleted by the other. `${fresh_dir:BASE}` (configs/config.yaml
names the run and sweep folders with it) claims BASE, or BASE-1, BASE-2, ... : the first that
does not exist yet, created at once (`os.mkdir` is atomic, so two claims never get the same one).

Resolved once per process (OmegaConf's resolver cache, which Hydra copies to every job of a
sweep); a folder that cannot be created is a ConfigError naming it and why.
"""

from __future__ import annotations

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
