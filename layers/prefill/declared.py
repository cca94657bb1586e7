"""The CP prefill snapshots' declarations (`layers.contract.declaration`; torch-free): the
reference's prefill_cp_swa.py, prefill_cp_hca.py and prefill_cp_csa.py layouts, told by their
layout tables (HCA's by its compressed pool besides, CSA's by its indexer pool); cp is x_hc's
leading axis. The first whose marks a snapshot holds is its layer's, so CSA's (which holds a
compressed pool too) comes first, then HCA's."""

from ..contract.declaration import Declaration, Dim

_DIMS = (
    Dim("hidden_size", ("in/x_hc",), -1),
    Dim("hc_mult", ("in/x_hc",), -2),
    Dim("num_attention_heads", ("in/attn_sink",), 0),
    Dim("head_dim", ("in/kv_cache",), -1),
    Dim("q_lora_rank", ("in/wq_a",), -1),
    Dim("o_lora_rank", ("in/wo_a",), -2),
    Dim("o_groups", ("in/wo_a",), 0),
    Dim("qk_rope_head_dim", ("in/freqs_cos",), -1),
    Dim("max_position_embeddings", ("in/freqs_cos",), 0),
    Dim("sliding_window", ("in/final_slot_mapping",), 0),
)
_MARKS = ("reverse_index", "overlay_active_lengths")

PHASE_DECLARATIONS = tuple(
    Declaration(name, phase="prefill", marks=marks, group_key="cp", anchors=("in/x_hc",), dims=_DIMS)
    for name, marks in (("csa", (*_MARKS, "idx_kv_cache")), ("hca", (*_MARKS, "cmp_kv")), ("swa", _MARKS)))
