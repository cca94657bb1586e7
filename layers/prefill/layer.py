"""The SWA CP prefill layer as the launcher runs it (the `Layer` interface), and the golden.

One layer per layout (`of_case`): zigzag walks `swa.stages()` (the tail exchange), contiguous
`gathered.stages()` (the replicated-KV all-gather) on the rank's CP group; both are judged
against the same golden. The golden is the independent
whole-prompt golden (`golden.whole_prompt`) cut to the rank: computed by the group together
(`rank_golden`), since a rank holds only its own segments of the prompt. `from_reference`
turns the reference's tensors (its snapshot's layout) into one rank's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..contract.checks import Check
from ..contract.config import SMALL
from ..contract.context import RankContext
from ..contract.tensors import Kind, TensorSpec
from ..distributed import wire
from ..contract.staged import StagedLayer
from . import collectives, fixture, gathered, golden as golden_math, swa, tables
from .case import MAX_SEGMENT_TILES, PREFILL_BLOCK_ROWS, PrefillCase

COMPARED = ("kv_cache", "x_out")


def golden(case: PrefillCase, ranks: Sequence[int], prompt: torch.Tensor,
           tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The expected kv_cache and x_out of each of `ranks`, from the whole prompt [total, HC, D]
    and the (replicated) weights and initial cache of `tensors`; the prompt is run once."""
    x_out, _, final = golden_math.whole_prompt(case, tensors, prompt, tensors["kv_cache"])
    return [{"kv_cache": final, "x_out": golden_math.rank_slice(case, r, x_out).flatten(0, 2)} for r in ranks]


def from_reference(stacked: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank's inputs from the reference's tensors (`in/<name>.pt` of its snapshot): the
    replicated ones whole, the others' rank slice."""
    return {n: stacked[n] if n in LAYER.replicated_inputs else stacked[n][rank].clone() for n in LAYER_INPUTS}


class PrefillSWALayer(StagedLayer):
    """The zigzag layout's layer: the tail exchange (`swa.stages()`)."""

    name = "swa"
    replicated_inputs = frozenset(fixture.WEIGHTS) | {"freqs_cos", "freqs_sin", "segment_starts_t", "reverse_index",
                                                      "final_win_seg_src", "final_win_row_src", "final_slot_mapping",
                                                      "owner_rank_table"}
    sharded_o_weights = False  # every rank holds every head and the full O weights

    def stages(self, model) -> tuple:
        return swa.stages()

    def validate(self, case: PrefillCase) -> None:
        case.validate()

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return swa.default_checks()

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        """The reference's names; x_hc and kv_cache, the per-rank tables and x_out per rank,
        everything else replicated (its snapshot holds those once). x_out is computed as the
        layout's rows flattened [2·tiles·WIN, HC, D] and stored in the layout."""
        m, w = case.model, case.window
        f32, bf16, i32, i8 = torch.float32, torch.bfloat16, torch.int32, torch.int8
        rows = (tables.LOCAL_PARTS, MAX_SEGMENT_TILES, w)
        ql, h, hd, d, g = m.q_lora_rank, m.num_attention_heads, m.head_dim, m.hidden_size, m.o_groups
        nseg, rope = case.num_segments, (m.max_position_embeddings, m.qk_rope_head_dim)

        def rep(shape, dtype):
            return TensorSpec(shape, dtype, Kind.INPUT, replicated=True)

        def own(shape, dtype):
            return TensorSpec(shape, dtype, Kind.INPUT)

        return {
            "x_hc": own((*rows, m.hc_mult, d), f32),
            "hc_attn_fn": rep((m.mix_hc, m.hc_dim), f32),
            "hc_attn_scale": rep((3,), f32),
            "hc_attn_base": rep((m.mix_hc,), f32),
            "attn_norm_w": rep((d,), bf16),
            "wq_a": rep((d, ql), bf16),
            "wq_b": rep((ql, h * hd), i8),
            "wq_b_scale": rep((h * hd,), f32),
            "wkv": rep((d, hd), bf16),
            "gamma_cq": rep((ql,), bf16),
            "gamma_ckv": rep((hd,), bf16),
            "freqs_cos": rep(rope, bf16),
            "freqs_sin": rep(rope, bf16),
            "kv_cache": TensorSpec((m.prefill_ori_block_num, PREFILL_BLOCK_ROWS, 1, hd), bf16, Kind.INOUT),
            "attn_sink": rep((h,), f32),
            "wo_a": rep((g, m.o_lora_rank, m.group_in), bf16),
            "wo_b": rep((d, g * m.o_lora_rank), i8),
            "wo_b_scale": rep((d,), f32),
            "segment_starts_t": rep((nseg,), i32),
            "predecessor_segments": own((tables.LOCAL_PARTS,), i32),
            "query_position_ids": own(rows, i32),
            "overlay_active_lengths": own((*rows[:2], 2), i32),
            "reverse_index": rep((nseg,), i32),
            "final_win_seg_src": rep((w,), i32),
            "final_win_row_src": rep((w,), i32),
            "final_slot_mapping": rep((w,), i32),
            "owner_rank_table": rep((nseg,), i32),
            **self.layout_tables(case),
            "x_out": TensorSpec((case.local_t, m.hc_mult, d), f32, Kind.OUTPUT, stored=(*rows, m.hc_mult, d)),
        }

    def layout_tables(self, case: PrefillCase) -> dict[str, TensorSpec]:
        """The tables only this layout's stage list reads (none beside the reference's)."""
        return {}

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        return fixture.rank_inputs(case, rank)

    def full_o_weights(self, case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor]:
        w = fixture.weights(case)
        return w["wo_a"], w["wo_b"]

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole prompt run once on one process from the group's tensors in the reference's
        layout (the per-rank ones stacked [cp, ...], the replicated ones whole); outputs stacked."""
        ranks = [from_reference(tensors, r) for r in range(case.cp)]
        prompt = golden_math.prompt_of(case, torch.stack([r["x_hc"] for r in ranks]))
        first = ranks[0]
        outs = golden(case, range(case.cp), prompt, {**first, "kv_cache": first["kv_cache"].clone()})
        return {n: torch.stack([o[n] for o in outs]) for n in COMPARED}

    def rank_golden(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's x_hc gathered (the harness's all-gather), the whole prompt run once."""
        case = ctx.case
        every_x = wire.all_gather(tensors["x_hc"].contiguous(), ctx.group, case.cp)
        prompt = golden_math.prompt_of(case, every_x)
        cpu = {n: t.cpu() for n, t in tensors.items()}
        return golden(case, [ctx.rank], prompt, {**cpu, "kv_cache": cpu["kv_cache"].clone()})[0]


class GatheredPrefillSWALayer(PrefillSWALayer):
    """The contiguous layout's layer: the replicated-KV all-gather (`gathered.stages()`)."""

    replicated_inputs = PrefillSWALayer.replicated_inputs | {"gathered_slot_mapping"}

    def stages(self, model) -> tuple:
        return gathered.stages()

    def layout_tables(self, case: PrefillCase) -> dict[str, TensorSpec]:
        rows = case.cp * case.local_t
        return {"gathered_slot_mapping": TensorSpec((rows,), torch.int32, Kind.INPUT, replicated=True)}


LAYER = PrefillSWALayer()
GATHERED = GatheredPrefillSWALayer()
LAYOUTS = {"zigzag": LAYER, "contiguous": GATHERED}


def of_case(case: PrefillCase, scope: str | None = None) -> StagedLayer:
    """The layer of the case's layout, or its exchange alone under scope=collectives (`scope`:
    in place of the case's own). An unknown layout or scope: the zigzag layer, whose validate
    refuses it."""
    if (case.scope if scope is None else scope) == "collectives":
        return collectives.SCOPE
    return LAYOUTS.get(case.cp_layout, LAYER)


# Every input of a rank of the reference's layout, by name (the model and case do not change
# them; the contiguous layout adds gathered_slot_mapping, which the golden does not read).
LAYER_INPUTS = tuple(n for n, s in LAYER.tensor_specs(PrefillCase("swa", SMALL, 1, 0)).items()
                     if s.kind is not Kind.OUTPUT)

__all__ = ["COMPARED", "LAYER_INPUTS", "golden", "from_reference", "PrefillSWALayer", "GatheredPrefillSWALayer",
           "LAYER", "GATHERED", "LAYOUTS", "of_case"]
