"""The prefill layers by name, and the one a case runs (its layer, layout and scope)."""

from __future__ import annotations

from ..contract.staged import StagedLayer
from . import csa_layer, hca_layer, layer as swa_layer
from .case import PrefillCase

PREFILL = {layer.name: layer for layer in (swa_layer.LAYER, hca_layer.LAYER, csa_layer.LAYER)}


def of_case(case: PrefillCase, scope: str | None = None) -> StagedLayer:
    """The layer of the case by layer, layout and scope (`layer.of_case`, `hca_layer.of_case`,
    `csa_layer.of_case`)."""
    if case.layer == hca_layer.LAYER.name:
        return hca_layer.of_case(case, scope)
    if case.layer == csa_layer.LAYER.name:
        return csa_layer.of_case(case, scope)
    return swa_layer.of_case(case, scope)


__all__ = ["PREFILL", "of_case"]
