"""What every rank would otherwise work out on its first job, worked out once in the forkserver
(its last preload, `launcher.run.forkserver.PRELOAD`), so that each forked rank inherits it:
the hash of the layers' source that keys the golden cache (reading and hashing every file,
20 ms per rank: 0.16 s of CPU for a cold tp=8 group). The launcher never imports this module."""

from launcher.store import golden_cache

golden_cache.code_version()
