"""What every rank would otherwise work out on its first job, worked out once in the forkserver
(its last preload, `launcher.run.forkserver.PRELOAD`), so that each forked rank inherits it:
the hash of the layers' source that keys the golden cache (reading and hashing every file,
20 ms per rank: 0.16 s of CPU for a cold tp=8 group), and the modules Hydra's instantiate and
torch.load import on their first call (a rank's implementation, its golden cache read), and
the note of what the golden can reach (`launcher.run.golden_guard`), taken in a process that
never imports an implementation. Last, the garbage collector the first preload paused is
resumed (`launcher.run.import_gc`). The launcher never imports this module."""

import contextlib

from hydra.utils import instantiate

from launcher.run import golden_guard, import_gc
from launcher.store import golden_cache

golden_cache.code_version()
instantiate({"_target_": "builtins.dict"})
with contextlib.suppress(ImportError):  # torch.load's config module, where this torch has one
    import torch.utils.serialization  # noqa: F401

golden_guard.record()  # what the golden can reach, before any rank imports an implementation
import_gc.resume()  # every import is done: freeze what they made, before any rank is forked
