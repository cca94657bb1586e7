"""The whole decoder layer, `layer=block`: attention in TP groups, then the MoE expert-parallel."""

from .case import BlockCase
from .layer import LAYER, BlockLayer

__all__ = ["BlockCase", "BlockLayer", "LAYER"]
