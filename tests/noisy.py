"""A correct implementation with a device's rounding noise, for measuring false positives.

The default implementation is bitwise equal to the golden on CPU, so a check that never fails
it says nothing about a device, whose kernels round differently. `Dithered` runs the layer's
own stages and perturbs every fresh floating output of every stage (not the in-out pools it
updates in place, so unmapped rows stay untouched) by a relative `rel * u`, u uniform in
[-1, 1], then rounds back to the tensor's dtype: at `rel` = 2^-9 about a quarter of a bf16
tensor's values move by one ulp. The noise then flows through the rest of the step as a
device's would: through the softmax, the quantizers (int8 codes flip), the routing weights
and the collectives, concentrating wherever the layer is sensitive (near-cancellations, hot
tokens), which independent per-element noise would not.

`python -m launcher layer=moe ep=2 model=tiny impl._target_=tests.noisy.Dithered +impl.rel=0.004`
"""

from __future__ import annotations

import zlib

import torch

from layers.tp import TorchTP


class Dithered(TorchTP):
    """The layer's own stages, each fresh floating output perturbed by up to `rel` (relative)."""

    def __init__(self, rel: float = 2**-9, seed: int = 0):
        self.rel, self.seed = float(rel), int(seed)

    def run_stage(self, stage, ctx, values):
        out = super().run_stage(stage, ctx, values)
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{ctx.global_rank}/{stage.name}".encode()))
        for name, t in out.items():
            if name in stage.reads or not t.is_floating_point() or not t.numel():
                continue
            u = torch.rand(t.shape, generator=g, dtype=torch.float32).mul_(2).sub_(1).mul_(self.rel)
            out[name] = (t.to(torch.float32) * (1 + u)).to(t.dtype)
        return out
