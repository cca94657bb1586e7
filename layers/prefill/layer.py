"""The SWA CP prefill layer as the launcher runs it (the `Layer` interface), and the golden.

`forward` walks `swa.stages()` on the rank's CP group. The golden is the independent
whole-prompt golden (`golden.whole_prompt`) cut to the rank: computed by the group together
(`golden_of_group`), since a rank holds only its own segments of the prompt. `from_reference`
turns the reference's rank-stacked tensors into one rank's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..contract.checks import Check
from ..contract.context import RankContext
from ..contract.tensors import Kind, TensorSpec
from ..distributed import wire
from ..staged import StagedLayer
from . import fixture, golden as golden_math, swa, tables
from .case import MAX_SEGMENT_TILES, PREFILL_BLOCK_ROWS, PREFILL_ORI_BLOCKS, PrefillCase

COMPARED = ("kv_cache", "x_out")


def golden(case: PrefillCase, ranks: Sequence[int], prompt: torch.Tensor,
           tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The expected kv_cache and x_out of each of `ranks`, from the whole prompt [total, HC, D]
    and the (replicated) weights and initial cache of `tensors`; the prompt is run once."""
    x_out, _, final = golden_math.whole_prompt(case, tensors, prompt, tensors["kv_cache"])
    return [{"kv_cache": final, "x_out": golden_math.rank_slice(case, r, x_out).flatten(0, 2)} for r in ranks]


def from_reference(case: PrefillCase, stacked: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank's inputs from the reference's rank-stacked tensors (weights are replicated there)."""
    own = {n: stacked[n] for n in (*fixture.WEIGHTS, "freqs_cos", "freqs_sin")}
    return {**own, "x_hc": stacked["x_hc"][rank], "kv_cache": stacked["kv_cache"][rank].clone(),
            **fixture.rank_tables(case, rank)}


class PrefillSWALayer(StagedLayer):
    name = "swa"
    sharded_o_weights = False  # every rank holds every head and the full O weights
    golden_per_rank = False  # the golden needs the whole prompt: every rank's segments

    def stages(self, model) -> tuple:
        return swa.stages()

    def validate(self, case: PrefillCase) -> None:
        case.validate()

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return swa.default_checks()

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        m, w, inp = case.model, case.window, Kind.INPUT
        f32, bf16, i32, i8 = torch.float32, torch.bfloat16, torch.int32, torch.int8
        rows = (tables.LOCAL_PARTS, MAX_SEGMENT_TILES, w)
        ql, h, hd, d, g = m.q_lora_rank, m.num_attention_heads, m.head_dim, m.hidden_size, m.o_groups
        nseg = case.num_segments
        return {
            "x_hc": TensorSpec((*rows, m.hc_mult, d), f32, inp),
            "hc_attn_fn": TensorSpec((m.mix_hc, m.hc_dim), f32, inp),
            "hc_attn_scale": TensorSpec((3,), f32, inp),
            "hc_attn_base": TensorSpec((m.mix_hc,), f32, inp),
            "attn_norm_w": TensorSpec((d,), bf16, inp),
            "wq_a": TensorSpec((d, ql), bf16, inp),
            "wq_b": TensorSpec((ql, h * hd), i8, inp),
            "wq_b_scale": TensorSpec((h * hd,), f32, inp),
            "wkv": TensorSpec((d, hd), bf16, inp),
            "gamma_cq": TensorSpec((ql,), bf16, inp),
            "gamma_ckv": TensorSpec((hd,), bf16, inp),
            "freqs_cos": TensorSpec((m.max_position_embeddings, m.qk_rope_head_dim), bf16, inp),
            "freqs_sin": TensorSpec((m.max_position_embeddings, m.qk_rope_head_dim), bf16, inp),
            "kv_cache": TensorSpec((PREFILL_ORI_BLOCKS, PREFILL_BLOCK_ROWS, 1, hd), bf16, Kind.INOUT),
            "attn_sink": TensorSpec((h,), f32, inp),
            "wo_a": TensorSpec((g, m.o_lora_rank, m.group_in), bf16, inp),
            "wo_b": TensorSpec((d, g * m.o_lora_rank), i8, inp),
            "wo_b_scale": TensorSpec((d,), f32, inp),
            "query_position_ids": TensorSpec(rows, i32, inp),
            "segment_active_lengths": TensorSpec((tables.LOCAL_PARTS,), i32, inp),
            "predecessor_segments": TensorSpec((tables.LOCAL_PARTS,), i32, inp),
            "reverse_index": TensorSpec((nseg,), i32, inp),
            "owner_rank_table": TensorSpec((nseg,), i32, inp),
            "final_win_seg_src": TensorSpec((w,), i32, inp),
            "final_win_row_src": TensorSpec((w,), i32, inp),
            "final_slot_mapping": TensorSpec((w,), i32, inp),
            "swa_key_rows": TensorSpec((*rows, w), i32, inp),
            "x_out": TensorSpec((case.local_t, m.hc_mult, d), f32, Kind.OUTPUT),
        }

    def rank_inputs(self, case: PrefillCase, rank: int) -> dict[str, torch.Tensor]:
        return fixture.rank_inputs(case, rank)

    def full_o_weights(self, case: PrefillCase) -> tuple[torch.Tensor, torch.Tensor]:
        w = fixture.weights(case)
        return w["wo_a"], w["wo_b"]

    def golden(self, case: PrefillCase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError("the prefill golden needs every rank's segments: golden_of_group")

    def golden_of_group(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's x_hc gathered (the harness's all-gather), the whole prompt run once."""
        case = ctx.case
        every_x = wire.all_gather(tensors["x_hc"].contiguous(), ctx.group, case.cp)
        prompt = golden_math.prompt_of(case, every_x)
        cpu = {n: t.cpu() for n, t in tensors.items()}
        return golden(case, [ctx.rank], prompt, {**cpu, "kv_cache": cpu["kv_cache"].clone()})[0]


LAYER = PrefillSWALayer()

__all__ = ["COMPARED", "golden", "from_reference", "PrefillSWALayer", "LAYER"]
