"""Python's cyclic garbage collector paused while a process imports torch and the harness,
and everything those imports made frozen once they are done.

Importing torch and the harness makes millions of objects that live as long as the process
and are almost never garbage; the collector walks them all again and again while they are
made (0.15 s of a tiny run's launcher, 0.19 s of the forkserver's preload, measured with
`gc.callbacks`), and every later full collection walks them once more. Importing this
module stops automatic collections (`pause()` stops them again); `resume()` moves every object alive by then into the
permanent generation (`gc.freeze`), which collections skip, and starts them again. The
launcher imports this first and resumes once its imports are done, and so does a worker
under torchrun (`python -m launcher.torchrun`); the forkserver imports it as its first
preload and resumes in its last (`launcher.run.rank_preload`), before it forks any rank: the
ranks' collections then skip the forkserver's objects too, and leave their pages shared
with it (a collection writes to every object it walks).

Torch-free and import-free, so that nothing is imported before the pause.
"""

import gc

gc.disable()


def pause() -> None:
    """Stop automatic collections again, for a later batch of such imports (the launcher's
    run, imported only once a run starts: `launcher.cli.RunStart`); `resume()` after it."""
    gc.disable()


def resume() -> None:
    gc.freeze()
    gc.enable()
