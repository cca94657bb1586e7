"""The HCA CP prefill layer as the launcher runs it (the `Layer` interface), zigzag, and the golden.

The SWA prefill layer's tensors (its `query_position_ids` named `query_positions`, as the HCA
reference names it) plus the compressor's weights, its two pools with their block tables and
the HCA reference's tables; judged against the whole-prompt golden (`hca_golden`), computed
by the group together (`rank_golden`), as the SWA prefill's.
"""

from __future__ import annotations

import torch

from ..components.hca_compressor import COMPRESS_RATIO
from ..contract.checks import Check
from ..contract.staged import StagedLayer
from ..contract.tensors import Kind, TensorSpec
from . import hca, hca_collectives, hca_fixture, hca_gathered, hca_golden, hca_tables, tables
from .case import PrefillCase
from .layer import GATHERED as GATHERED_SWA, PrefillSWALayer
from .whole_prompt import WholePromptLayer, per_rank, replicated

COMPARED = ("kv_cache", "cmp_kv", "compress_state", "x_out")


class PrefillHCALayer(WholePromptLayer):
    """The zigzag layout's HCA layer: tails of KV and hidden rows, the compressor, the compact exchange."""

    name = "hca"
    compared = COMPARED
    weights = staticmethod(hca_fixture.weights)
    inputs = staticmethod(hca_fixture.rank_inputs)
    prompt_golden = staticmethod(hca_golden.golden)
    # Held once in the reference's snapshot; every other input per rank (leading cp axis).
    replicated_inputs = PrefillSWALayer.replicated_inputs | set(hca.COMPRESSOR_WEIGHTS) | {
        "segment_tail_positions", "final_segment_t", "owner_part_table"}

    def stages(self, model) -> tuple:
        return hca.stages()

    def validate(self, case: PrefillCase) -> None:
        case.validate()
        hca_tables.check_case(case)

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return hca.default_checks()

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        m, w = case.model, case.window
        f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
        hd, d, nseg = m.head_dim, m.hidden_size, case.num_segments
        swa, x_out = self.swa_specs(case)
        rep, own = replicated, per_rank
        state_blocks = hca_tables.state_table(case).numel()
        return {
            **swa,
            "cmp_wkv": rep((hd, d), bf16),
            "cmp_wgate": rep((hd, d), bf16),
            "cmp_ape": rep((COMPRESS_RATIO, hd), f32),
            "cmp_norm_w": rep((hd,), bf16),
            "compress_state": own((hca_tables.STATE_PHYSICAL_BLOCKS, hca_tables.state_block_size(case), 2 * hd), f32,
                                  Kind.INOUT),
            "compress_state_block_table": own((state_blocks,), i32),
            "cmp_kv": own((hca_tables.CMP_BLOCK_NUM, hca_tables.CMP_STORAGE_BLOCK_SIZE, 1, hd), bf16, Kind.INOUT),
            "cmp_block_table": own((hca_tables.cmp_table(case).numel(),), i32),
            "segment_tail_positions": rep((nseg, w), i32),
            "snapshot_positions": own((tables.LOCAL_PARTS, w), i32),
            "snapshot_valid": own((tables.LOCAL_PARTS,), i32),
            "final_segment_t": rep((1,), i32),
            "owner_part_table": rep((nseg,), i32),
            "x_out": x_out,
        }


class GatheredPrefillHCALayer(PrefillHCALayer):
    """The contiguous layout's HCA layer: the replicated-KV all-gather of the projected KV and
    compressor-state rows, every compressed row made on every rank (`hca_gathered.stages()`)."""

    replicated_inputs = PrefillHCALayer.replicated_inputs | {"gathered_slot_mapping"}

    def stages(self, model) -> tuple:
        return hca_gathered.stages()

    def layout_tables(self, case: PrefillCase) -> dict[str, TensorSpec]:
        return GATHERED_SWA.layout_tables(case)


LAYER = PrefillHCALayer()
GATHERED = GatheredPrefillHCALayer()
LAYOUTS = {"zigzag": LAYER, "contiguous": GATHERED}


def of_case(case: PrefillCase, scope: str | None = None) -> StagedLayer:
    """The HCA layer of the case's layout, or its exchanges alone under scope=collectives
    (`scope`: in place of the case's own). An unknown layout or scope: the zigzag layer, whose
    validate refuses it."""
    if (case.scope if scope is None else scope) == "collectives":
        return hca_collectives.SCOPE
    return LAYOUTS.get(case.cp_layout, LAYER)


__all__ = ["COMPARED", "PrefillHCALayer", "GatheredPrefillHCALayer", "LAYER", "GATHERED", "LAYOUTS", "of_case"]
