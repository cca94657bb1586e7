"""The CSA CP prefill layer as the launcher runs it (the `Layer` interface), zigzag, and the golden.

The SWA prefill layer's tensors (its `query_position_ids` named `query_positions`, as the CSA
reference names it) plus both compressors' and the indexer's weights, the five pools with
their four block tables and the last segment; judged against the whole-prompt golden
(`csa_golden`), computed by the group together (`rank_golden`), as the SWA prefill's.
"""

from __future__ import annotations

import torch

from ..contract.checks import Check
from ..contract.config import ConfigError
from ..contract.staged import StagedLayer
from ..contract.tensors import Kind, TensorSpec
from . import csa, csa_collectives, csa_fixture, csa_golden, csa_tables
from .case import PrefillCase
from .layer import PrefillSWALayer
from .whole_prompt import WholePromptLayer, per_rank, replicated

COMPARED = ("kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale", "compress_state", "inner_compress_state", "x_out")


class PrefillCSALayer(WholePromptLayer):
    """The zigzag layout's CSA layer: tails of KV and hidden rows, both compressors, the compact
    exchange, the indexer."""

    name = "csa"
    compared = COMPARED
    weights = staticmethod(csa_fixture.weights)
    inputs = staticmethod(csa_fixture.rank_inputs)
    prompt_golden = staticmethod(csa_golden.golden)
    # Held once in the reference's snapshot; every other input per rank (leading cp axis).
    replicated_inputs = PrefillSWALayer.replicated_inputs | set(csa_fixture.COMPRESSOR_WEIGHTS) | set(
        csa_fixture.INDEXER_WEIGHTS) | {"final_segment_t"}

    def stages(self, model) -> tuple:
        return csa.stages()

    def validate(self, case: PrefillCase) -> None:
        case.validate()
        for key, built in (("cp_layout", "zigzag"), ("scope", "full")):  # the reference's layout, the whole step
            if getattr(case, key) != built:
                raise ConfigError(f"layer=csa phase=prefill runs {key}={built}; {key}={getattr(case, key)} is not "
                                  f"built for layer=csa yet")
        csa_tables.validate(case)

    def checks(self, case: PrefillCase) -> tuple[Check, ...]:
        return csa.default_checks()

    def tensor_specs(self, case: PrefillCase) -> dict[str, TensorSpec]:
        m = case.model
        f32, bf16, i32, i8 = torch.float32, torch.bfloat16, torch.int32, torch.int8
        hd, idd, d, ih = m.head_dim, m.index_head_dim, m.hidden_size, m.index_n_heads
        swa, x_out = self.swa_specs(case)
        rep, own = replicated, per_rank
        sb, cb = csa_tables.STATE_BLOCK_SIZE, csa_tables.CMP_STORAGE_BLOCK_SIZE
        states = csa_tables.STATE_PHYSICAL_BLOCKS
        return {
            **swa,
            **{f"{w}_wkv": rep((2 * dim, d), bf16) for w, dim in (("cmp", hd), ("inner", idd))},
            **{f"{w}_wgate": rep((2 * dim, d), bf16) for w, dim in (("cmp", hd), ("inner", idd))},
            **{f"{w}_ape": rep((4, 2 * dim), f32) for w, dim in (("cmp", hd), ("inner", idd))},
            **{f"{w}_norm_w": rep((dim,), bf16) for w, dim in (("cmp", hd), ("inner", idd))},
            "hadamard_idx": rep((idd, idd), bf16),
            "idx_wq_b": rep((m.q_lora_rank, ih * idd), i8),
            "idx_wq_b_scale": rep((ih * idd,), f32),
            "idx_weights_proj": rep((d, ih), bf16),
            "compress_state": own((states, sb, 4 * hd), f32, Kind.INOUT),
            "compress_state_block_table": own((csa_tables.state_table(case).numel(),), i32),
            "inner_compress_state": own((states, sb, 4 * idd), f32, Kind.INOUT),
            "inner_compress_state_block_table": own((csa_tables.inner_state_table(case).numel(),), i32),
            "cmp_kv": own((csa_tables.CMP_BLOCK_NUM, cb, 1, hd), bf16, Kind.INOUT),
            "cmp_block_table": own((csa_tables.cmp_table(case).numel(),), i32),
            "idx_kv_cache": own((csa_tables.IDX_BLOCK_NUM, cb, 1, idd), i8, Kind.INOUT),
            "idx_kv_scale": own((csa_tables.IDX_BLOCK_NUM, cb, 1, 1), f32, Kind.INOUT),
            "idx_block_table": own((csa_tables.idx_table(case).numel(),), i32),
            "final_segment_t": rep((1,), i32),
            "x_out": x_out,
        }


LAYER = PrefillCSALayer()


def of_case(case: PrefillCase, scope: str | None = None) -> StagedLayer:
    """The CSA layer, or its exchanges alone under scope=collectives (`scope`: in place of the
    case's own); whichever runs refuses the layout it does not build."""
    if (case.scope if scope is None else scope) == "collectives":
        return csa_collectives.SCOPE
    return LAYER


__all__ = ["COMPARED", "PrefillCSALayer", "LAYER", "of_case"]
