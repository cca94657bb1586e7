"""The CSA layer's snapshot declaration (`layers.contract.declaration`; torch-free)."""

from ..attention.declared import ANCHORS, COMPRESSED_DIMS, FRONT_DIMS, SCALARS, CASE_DIMS
from ..contract.declaration import Declaration, Dim

DECLARATIONS = (Declaration(
    "csa", marks=("idx_kv_cache", "idx_kv_scale", "inner_compress_state", "idx_wq_b"), shadows=("hca",),
    anchors=ANCHORS, scalars=SCALARS, case_dims=CASE_DIMS,
    dims=FRONT_DIMS + COMPRESSED_DIMS + (
        Dim("max_position_embeddings", ("in/freqs_cos",), 1),
        Dim("csa_state_physical_blocks", ("in/compress_state", "out/compress_state"), 1),
        Dim("c4a_state_block_size", ("in/compress_state", "out/compress_state"), 2),
        Dim("csa_inner_state_physical_blocks", ("in/inner_compress_state", "out/inner_compress_state"), 1),
        Dim("idx_cache_block_num", ("in/idx_kv_cache", "out/idx_kv_cache"), 1),
        Dim("index_head_dim", ("in/idx_kv_cache", "out/idx_kv_cache"), -1),
        Dim("index_n_heads", ("in/idx_wq_b",), derive=lambda shape, group, fields: shape[-1] // fields["index_head_dim"]),
    )),)
