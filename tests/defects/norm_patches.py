"""Implementations that replace a function the golden also runs (launcher.run.golden_guard).

`tests.kernel_patch` replaces it on import, as a kernel library would; it is a module of its own
because importing this one must change nothing."""

from __future__ import annotations

import torch

import layers.components.qkv
from layers.components.numerics import bf16
from layers.tp import TorchTP


_HARNESS_RMS_NORM = layers.components.qkv.rms_norm


def fast_rms_norm(x, norm_w, eps):
    """A kernel library's attention RMSNorm, up to 5 % off the harness's: a ramp over the features
    (a uniform scale would vanish in the norms that follow it)."""
    normed = _HARNESS_RMS_NORM(x, norm_w, eps).float()
    return bf16(normed * torch.linspace(0.95, 1.05, normed.shape[-1], device=normed.device))


def patch_rms_norm():
    """Replace the harness's RMSNorm, which the golden and the default implementation both call."""
    layers.components.qkv.rms_norm = fast_rms_norm


class PatchesNormInConstructor(TorchTP):
    """Replaces the harness's RMSNorm when built, then runs the default implementation with it."""

    def __init__(self):
        patch_rms_norm()


class PatchesNormDuringCall(TorchTP):
    """Replaces the harness's RMSNorm in its call, and leaves it replaced."""

    def __call__(self, ctx, tensors):
        patch_rms_norm()
        return super().__call__(ctx, tensors)


class PatchesNormWhenDropped(TorchTP):
    """Correct; replaces the harness's RMSNorm when the harness lets go of it, after every check
    of its job."""

    def __del__(self):
        patch_rms_norm()
