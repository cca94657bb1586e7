"""The CP prefill snapshot's declaration (`layers.contract.declaration`; torch-free): the
reference's prefill_cp_swa.py layout, told by its layout tables; cp is x_hc's leading axis."""

from ..contract.declaration import Declaration, Dim

PHASE_DECLARATIONS = (Declaration(
    "swa", phase="prefill", marks=("reverse_index", "overlay_active_lengths"), group_key="cp", anchors=("in/x_hc",),
    dims=(
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
    )),)
