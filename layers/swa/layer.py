"""The SWA decode layer (compress ratio 0) as its stage list (spec swa.md §6).

One rank's step is the spec's nine steps (§6): hc_pre, RMSNorm, Q/KV projection with RoPE
(`layers.attention.front`), the KV cache insert (§3.4) and the window attention (§3.5) below, then the
packing, the TP output half and hc_post (`layers.attention.output_half`). The golden runs the same list
on a single device with the full O weights (§3); the fixture is `layers.swa.fixture`.
"""

from __future__ import annotations

import torch

from ..attention import front, output_half
from ..attention.layer import AttentionLayer, check_distinct_writes
from ..components import attention
from ..components.kv_cache import write_rows
from ..contract.case import Case
from ..contract.checks import HIDDEN_AXES, Check, PoolCheck, RelDiffCheck
from ..contract.config import ConfigError, ModelConfig
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.tensors import FRONT_WEIGHTS, Kind, TensorSpec, front_tensor_specs, tail_tensor_specs
from . import fixture
from ..contract.staged import bf16_close, exact, judged


# -- the layer's own step (§3.5; the cache insert of §3.4 is components.kv_cache) ---------------------------------------------------------
def _cache_insert(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    write_rows(v["kv_cache"], v["swa_slot_mapping"], v["kv"])
    return {"kv_cache": v["kv_cache"]}


def _attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"o": attention.window_attention(ctx.model, v["q"], v["kv_cache"], v["swa_indices"], v["swa_lens"], v["attn_sink"])}


class SWALayer(AttentionLayer):
    name = "swa"
    o_recipe = fixture.O_RECIPE
    replicated_inputs = FRONT_WEIGHTS | {"attn_sink"}  # the fixture's `replicated_weights`

    def stages(self, model: ModelConfig) -> tuple[Stage, ...]:
        kv_cache, x_out = self._checks(model)
        return (
            front.HC_PRE,
            front.RMS_NORM,
            front.qkv_proj_rope(),
            Stage("cache_insert", ("kv_cache", "swa_slot_mapping", "kv"), (judged(exact("kv_cache"), kv_cache),),
                  _cache_insert),
            Stage("attention", ("q", "kv_cache", "swa_indices", "swa_lens", "attn_sink"), (judged(bf16_close("o")),),
                  _attention),
            *output_half.stages(x_out),
        )  # fmt: skip

    def checks(self, case: Case) -> tuple[Check, ...]:
        return self._checks(case.model)

    @staticmethod
    def _checks(model: ModelConfig) -> tuple[PoolCheck, RelDiffCheck]:
        # validation.md §12.1; validation order kv_cache, x_out.
        return (
            PoolCheck("kv_cache", mapping="swa_slot_mapping", block_size=model.block_size, atol=1e-4, rtol=1 / 128,
                      max_error_ratio=0.005, pool_name="KV cache"),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=1, axes=HIDDEN_AXES),
        )  # fmt: skip

    def start_positions(self, case: Case) -> list[list[int]]:
        return [fixture.rank_starts(case, rank) for rank in range(case.tp)]

    def validate(self, case: Case) -> None:
        m = case.model
        for rank in range(case.tp):
            starts = fixture.rank_starts(case, rank)
            # The SWA context ceiling is the 1 Mi long-context one (§10, #994).
            case.check_starts(starts, m.long_context_max_seq_len)
            meta = fixture.window_metadata(case, starts)
            check_distinct_writes(rank, starts, "swa_slot_mapping", "kv_cache", meta["swa_slot_mapping"],
                                  f" (the {m.kv_ori_block_num}-page pool wraps)")
            k = torch.arange(m.sliding_window)[None, :]
            holes = (k < meta["swa_lens"][:, None]) & (meta["swa_indices"] < 0)
            if holes.any():
                tok = int(torch.nonzero(holes)[0, 0])
                raise ConfigError(
                    f"rank {rank}: token {tok} (position {int(meta['position_ids'][tok])}) has an unmapped row "
                    f"inside its window; every in-window index must be >= 0 (swa.md §1.4, P3)"
                )

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m, t = case.model, case.local_t
        hd, r = m.head_dim, m.qk_rope_head_dim
        bf16_, i32, i64 = torch.bfloat16, torch.int32, torch.int64
        inp = Kind.INPUT
        return {
            **front_tensor_specs(m, t),
            "freqs_cos": TensorSpec((t, r), bf16_, inp),
            "freqs_sin": TensorSpec((t, r), bf16_, inp),
            "kv_cache": TensorSpec((m.kv_ori_block_num, m.block_size, 1, hd), bf16_, Kind.INOUT),
            "swa_slot_mapping": TensorSpec((t,), i64, inp),
            "swa_indices": TensorSpec((t, m.sliding_window), i32, inp),
            "swa_lens": TensorSpec((t,), i32, inp),
            "position_ids": TensorSpec((t,), i32, inp),
            **tail_tensor_specs(case),
        }

    def inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return fixture.inputs_without_o(case, rank)


LAYER = SWALayer()


def golden_decode_swa_tp1(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`golden_decode_swa_tp1` (§3): the layer on one device, on one rank's tensors with the full
    O weights; updates `tensors["kv_cache"]` in place; returns `{"kv_cache", "x_out"}`."""
    local_t = tensors["x_hc"].shape[0]
    return LAYER.golden(Case("swa", model, 1, local_t, 0), tensors)


__all__ = ["SWALayer", "LAYER", "golden_decode_swa_tp1"]
