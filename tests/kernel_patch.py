"""A stand-in for a kernel library that monkey-patches the harness when imported: importing this
module replaces `layers.components.qkv.rms_norm` with `tests.defects.norm_patches.fast_rms_norm` (5 % off), and
its implementation is the default one, which then runs the replaced RMSNorm. Never import it
into a process that computes goldens (the pytest process included): name it as `impl=` of a run
of its own."""

from layers.tp import TorchTP

from tests import defects

defects.patch_rms_norm()


class FastNormTP(TorchTP):
    """The default implementation, run with the RMSNorm this module installed."""
