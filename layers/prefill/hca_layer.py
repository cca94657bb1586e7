"""The HCA CP prefill layer as the launcher runs it (the `Layer` interface), zigzag, and the golden.

The SWA prefill layer's tensors (its `query_position_ids` named `query_positions`, as the HCA
reference names it) plus the compressor's weights, its two pools with their block tables and
the HCA reference's tables; judged against the whole-prompt golden (`hca_golden`), computed
by the group together (`rank_golden`), as the SWA prefill's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..components.hca_compressor import COMPRESS_RATIO
from ..contract.checks import Check
from ..contract.context import RankContext
from ..contract.staged import StagedLayer
from ..contract.tensors import Kind, TensorSpec
from ..distributed import wire
from . import golden as swa_golden
from . import hca, hca_collectives, hca_fixture, hca_gathered, hca_golden, hca_tables, tables
from .case import PrefillCase
from .layer import GATHERED as GATHERED_SWA, PrefillSWALayer

COMPARED = ("kv_cache", "cmp_kv", "compress_state", "x_out")


class PrefillHCALayer(PrefillSWALayer):
    """The zigzag layout's HCA layer: tails of KV and hidden rows, the compressor, the compact exchange."""

    name = "hca"
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
        swa = super().tensor_specs(case)
        x_out = swa.pop("x_out")

        def rep(shape, dtype):
            return TensorSpec(shape, dtype, Kind.INPUT, replicated=True)

        def own(shape, dtype, kind=Kind.INPUT):
            return TensorSpec(shape, dtype, kind)

        state_blocks = hca_tables.state_table(case).numel()
        return {
            **{("query_positions" if n == "query_position_ids" else n): s for n, s in swa.items()},
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

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        built = hca_fixture.rank_inputs(case, rank)
        return {n: built[n] for n, s in self.tensor_specs(case).items() if s.kind is not Kind.OUTPUT}

    def full_o_weights(self, case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor]:
        w = hca_fixture.weights(case)
        return w["wo_a"], w["wo_b"]

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole prompt on one process from the group's tensors in the reference's layout
        (the per-rank ones stacked [cp, ...]); outputs stacked."""
        ranks = [self.of_rank(tensors, r) for r in range(case.cp)]
        prompt = swa_golden.prompt_of(case, torch.stack([r["x_hc"] for r in ranks]))
        outs = [self.rank_rows(case, r, o) for r, o in enumerate(hca_golden.golden(case, ranks, prompt))]
        return {n: torch.stack([o[n] for o in outs]) for n in COMPARED}

    def rank_golden(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's x_hc gathered (the harness's all-gather), the whole prompt run once."""
        case = ctx.case
        prompt = swa_golden.prompt_of(case, wire.all_gather(tensors["x_hc"].contiguous(), ctx.group, case.cp))
        cpu = {n: t.cpu() for n, t in tensors.items()}
        return self.rank_rows(case, ctx.rank, hca_golden.golden(case, [cpu], prompt)[0])

    @staticmethod
    def rank_rows(case: PrefillCase, rank: int, out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A rank's golden: x_out cut to its layout rows, the pools as they are."""
        return {**out, "x_out": swa_golden.rank_slice(case, rank, out["x_out"]).flatten(0, 2)}

    def of_rank(self, stacked: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank's inputs from tensors in the reference's layout: per-rank ones sliced."""
        return {n: t if n in self.replicated_inputs else t[rank].clone() for n, t in stacked.items()}


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
