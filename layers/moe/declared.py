"""The MoE layer's snapshot declaration (`layers.contract.declaration`; torch-free): moe.md §3's
expert weights, its hash table and output tell it; ep is the leading axis."""

from ..contract.declaration import Declaration, Dim

DECLARATIONS = (Declaration(
    "moe", marks=("x_next", "tid2eid", "routed_w1", "shared_w1"), shadows=("output",), group_key="ep",
    anchors=("in/x_hc", "out/x_next"), scalars=("layer_id", "num_tokens"),
    dims=(
        Dim("hidden_size", ("in/x_hc", "out/x_next"), -1),
        Dim("hc_mult", ("in/x_hc", "out/x_next"), -2),
        Dim("moe_intermediate_size", ("in/shared_w1", "in/routed_w1"), -2),
        Dim("vocab_size", ("in/tid2eid",), 1),
        Dim("num_experts_per_tok", ("in/tid2eid",), -1),
    )),)
