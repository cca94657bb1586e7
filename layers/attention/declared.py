"""The attention layers' shared snapshot dims (front and tail, compressed pools) and the focused
scopes' declarations (`layers.contract.declaration`; torch-free)."""

from __future__ import annotations

from ..contract.declaration import Declaration, Dim


def o_groups(shape: tuple, group: int, fields: dict) -> int:
    # wo_a's last axis is one group's input width heads_per_group * head_dim.
    return fields["num_attention_heads"] * fields["head_dim"] // shape[-1]


# The dims every attention layer's front and tail fix (rank-stacked shapes: axis 0 is the rank).
FRONT_DIMS = (
    Dim("hidden_size", ("in/x_hc", "out/x_out"), -1),
    Dim("hc_mult", ("in/x_hc", "out/x_out"), -2),
    Dim("q_lora_rank", ("in/wq_a",), -1),
    Dim("head_dim", ("in/wkv",), -1),
    Dim("num_attention_heads", ("in/attn_sink",), -1),
    Dim("o_lora_rank", ("in/wo_a",), -2),
    Dim("o_groups", ("in/wo_a",), derive=o_groups),
    Dim("kv_ori_block_num", ("in/kv_cache", "out/kv_cache"), 1),
    Dim("block_size", ("in/kv_cache", "out/kv_cache"), 2),
    Dim("qk_rope_head_dim", ("in/freqs_cos",), -1),
)
# The compressed layers' (hca, csa) window and compressed pool.
COMPRESSED_DIMS = (
    Dim("sliding_window", ("in/window_swa_indices",), -1),
    Dim("kv_cmp_block_num", ("in/cmp_kv", "out/cmp_kv"), 1),
)
# The file to cite for tp in an attention layer's snapshot.
ANCHORS = ("in/x_hc", "out/x_out", "in/wo_a")
# tokens per rank, saved as in/local_t.pt, else x_out's token axis.
SCALARS = ("local_t",)


def _token_axis(shape: tuple, group: int, fields: dict) -> int:
    if len(shape) != 4:  # [P, t, hc, D]; another shape is named by the shape check
        raise IndexError(shape)
    return shape[1]


CASE_DIMS = (Dim("local_t", ("out/x_out",), derive=_token_axis),)

DECLARATIONS = (
    Declaration(
        "output", marks=("proj_attention_local_groups", "proj_wo_a"), shadows=("collectives",), scope=True,
        anchors=("in/q", "out/o_local"),
        dims=(
            Dim("num_attention_heads", ("in/q",), -2),
            Dim("head_dim", ("in/q",), -1),
            Dim("hidden_size", ("in/wo_b", "out/o_local"),
                derive=lambda shape, group, fields: shape[1] if len(shape) == 3 else shape[-1]),
            Dim("o_lora_rank", ("in/wo_a",), -2),
            Dim("o_groups", ("in/wo_a",), derive=o_groups),
            Dim("kv_ori_block_num", ("in/kv_cache",), 1),
            Dim("block_size", ("in/kv_cache",), 2),
            Dim("sliding_window", ("in/swa_indices",), -1),
            Dim("qk_rope_head_dim", ("in/freqs_cos",), -1),
        )),
    Declaration(
        "collectives", marks=("kv_group", "kv_local", "attention_local_groups"), shadows=("csa",),
        scope=True, anchors=("in/kv_local", "out/o_local"),
        dims=(Dim("hidden_size", ("in/kv_local", "out/o_local"), -1),)),
)

__all__ = ["FRONT_DIMS", "COMPRESSED_DIMS", "ANCHORS", "SCALARS", "CASE_DIMS", "DECLARATIONS", "o_groups"]
