"""The SWA layer's snapshot declaration (`layers.contract.declaration`; torch-free)."""

from ..attention.declared import ANCHORS, FRONT_DIMS, SCALARS, CASE_DIMS
from ..contract.declaration import Declaration, Dim

DECLARATIONS = (Declaration(
    "swa", marks=("swa_slot_mapping", "swa_indices", "x_out", "x_hc"), anchors=ANCHORS, scalars=SCALARS, case_dims=CASE_DIMS,
    dims=FRONT_DIMS + (Dim("sliding_window", ("in/swa_indices",), -1),)),)
