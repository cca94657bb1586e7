"""Each layer's stages for a case, and the tensors an implementation exposes them through.

A layer's stages are its one stage list (`layers.contract.stage`, run by `layers.contract.staged`):
SWA: hc_pre, rms_norm, qkv_proj_rope, cache_insert, attention (swa.md §6); CSA: hc_pre,
rope_rows, rms_norm, qkv_proj_rope, compressor, indexer_query, indexer_compressor,
indexer_topk, cache_insert, attention (csa.md §3); HCA: hc_pre, rms_norm, qkv_proj_rope,
compressor, cache_insert, attention (hca.md §4); then every layer's pack_heads,
group_all_to_all, sharded_o_proj, reduce_scatter, hc_post (swa.md §5). The block's list is
its two halves' with the hand-off between them (`layers.block.stages`). Bisect walks them; an
implementation that is not stage-based takes part by returning the stages' tensors, under
the names `stage_tensors` lists, beside its outputs.
"""

from __future__ import annotations

from .block.layer import BlockLayer
from .contract.case import Case
from .contract.config import ConfigError
from .contract.stage import Stage
from .registry import layer_of
from .contract.staged import StagedLayer


def layer_stages(case: Case) -> tuple[Stage, ...]:
    """The stages of the case's layer (scope full), in order."""
    layer = layer_of(case, scope="full")
    if isinstance(layer, BlockLayer):  # its list depends on its attention kind, not on the model alone
        return layer.case_stages(case)
    if not isinstance(layer, StagedLayer):
        raise ConfigError(f"layer {case.layer!r} has no stage list")
    return layer.stages(case.model)


def stage_tensors(case: Case) -> dict[str, tuple[str, ...]]:
    """Stage name → the tensors a user implementation may return to expose that stage."""
    return {s.name: s.output_names for s in layer_stages(case)}


__all__ = ["layer_stages", "stage_tensors"]
