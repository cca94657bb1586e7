"""The HCA layer's snapshot declaration (`layers.contract.declaration`; torch-free)."""

from ..attention.declared import ANCHORS, COMPRESSED_DIMS, FRONT_DIMS, SCALARS, CASE_DIMS
from ..contract.declaration import Declaration, Dim

DECLARATIONS = (Declaration(
    "hca", marks=("cmp_kv", "cmp_freqs_cos"), shadows=("swa",), anchors=ANCHORS, scalars=SCALARS, case_dims=CASE_DIMS,
    dims=FRONT_DIMS + COMPRESSED_DIMS + (
        Dim("hca_state_physical_blocks", ("in/compress_state", "out/compress_state"), 1),
        Dim("c128_state_block_size", ("in/compress_state", "out/compress_state"), 2),
        Dim("decode_batch", ("in/cmp_freqs_cos",), derive=lambda shape, group, fields: shape[1] * group),
    )),)
