"""The CP prefill snapshots' declarations (`layers.contract.declaration`; torch-free): the
reference's prefill_cp_swa.py, prefill_cp_hca.py and prefill_cp_csa.py layouts, told by their
layout tables (HCA's by its compressed pool besides, CSA's by its indexer pool), cp x_hc's leading
axis; then the exchanges alone (scope=collectives), told by their sources. The first whose marks
a snapshot holds is its layer's, so CSA's (which holds a compressed pool too) comes first, then
HCA's."""

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
    Dim("prefill_ori_block_num", ("in/kv_cache",), 1),  # the raw-KV ring's pages
)
_MARKS = ("reverse_index", "overlay_active_lengths")
# scope=collectives: an exchange's sources alone (layers/prefill/collectives.py, hca_collectives.py,
# csa_collectives.py; CSA's hold HCA's tails and its indexer rows besides, so CSA's come first),
# the case in our manifest; each layout's by its source, cited from it.
_EXCHANGE_DIMS = (Dim("head_dim", ("in/local_kv_tail", "in/kv"), -1),
                  Dim("hidden_size", ("in/local_hidden_tail",), -1))
_EXCHANGES = (("csa", ("local_kv_tail", "local_hidden_tail", "reverse_index", "idx_payload")),
              ("hca", ("local_kv_tail", "local_hidden_tail", "reverse_index")), ("swa", ("local_kv_tail", "reverse_index")),
              ("hca", ("kv", "local_state")), ("swa", ("kv",)))

PHASE_DECLARATIONS = (
    *(Declaration(name, phase="prefill", marks=marks, group_key="cp", anchors=("in/x_hc",), dims=_DIMS)
      for name, marks in (("csa", (*_MARKS, "idx_kv_cache")), ("hca", (*_MARKS, "cmp_kv")), ("swa", _MARKS))),
    *(Declaration(name, phase="prefill", marks=marks, group_key="cp", anchors=(f"in/{marks[0]}",), dims=_EXCHANGE_DIMS)
      for name, marks in _EXCHANGES),
)
