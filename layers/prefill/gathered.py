"""The SWA CP prefill of the contiguous layout as its stage list: the replicated-KV variant
(docs/prefill.md §3b; the dspark tree's prefill_kv_allgather.py and its CP prefill_swa.py).

Each rank projects its contiguous block of the prompt (segments 2r and 2r+1) as the zigzag
list does, then all-gathers every rank's projected KV rows rank-major, so every rank holds the
KV of the whole step: each query attends over the gathered keys (history from the cache ring),
and every rank commits the final window from the gathered rows through
`gathered_slot_mapping`. The projection, the O projection and hc_post are the zigzag list's
own stages; what differs is the one collective and what reads it.
"""

from __future__ import annotations

import torch

from ..components import attention
from ..contract.checks import AllcloseCheck
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import bf16_close, exact, judged
from . import exchange, swa, tables


def _kv_allgather(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"gathered_kv": exchange.kv_allgather(v["kv"], ctx.group, ctx.tp)}


def _kv_allgather_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The same movement from every rank's kv stacked [P, rows, HD]."""
    return {"gathered_kv": exchange.rank_major(v["kv"])}


def key_table(ctx: RankContext, v: Values, positions: str = "query_position_ids") -> dict[str, torch.Tensor]:
    """The gathered_key_table stage; `positions`: the name of the rank's query position table
    (HCA's reference calls it query_positions)."""
    rows = tables.gathered_key_rows(v[positions], v["overlay_active_lengths"], v["segment_starts_t"],
                                    v["reverse_index"], ctx.case.window, v["kv_cache"][..., 0, 0].numel())
    return {"swa_key_rows": rows}


def _window_attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    m = ctx.model
    hd = v["gathered_kv"].shape[-1]
    staged = torch.cat((v["kv_cache"].reshape(-1, hd), v["gathered_kv"]))
    keys, valid = attention.gather_rows(staged, v["swa_key_rows"].reshape(-1, m.sliding_window))
    return {"o": attention.sparse_attention(v["q"], keys, valid, v["attn_sink"], m.softmax_scale)}


def _final_window(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """Every rank writes the gathered rows of the final window at their cache rows."""
    cache, slots = v["kv_cache"], v["gathered_slot_mapping"]
    keep = slots >= 0
    cache.view(-1, cache.shape[-1])[slots[keep].long()] = v["gathered_kv"][keep]
    return {"kv_cache": cache}


def stages() -> tuple[Stage, ...]:
    kv_check, _ = swa.default_checks()
    shared = {s.name: s for s in swa.stages()}
    return (
        shared["project"],
        Stage("kv_allgather", ("kv",), (judged(exact("gathered_kv"), bf16_close("gathered_kv")),),
              _kv_allgather, reference=_kv_allgather_reference, every_rank=("kv",)),
        Stage("gathered_key_table", ("query_position_ids", "overlay_active_lengths", "segment_starts_t", "reverse_index",
                                     "kv_cache"), (judged(exact("swa_key_rows")),), key_table),
        Stage("window_attention", ("q", "gathered_kv", "kv_cache", "swa_key_rows", "attn_sink"),
              (judged(AllcloseCheck("o", atol=1e-4, rtol=1 / 128)),), _window_attention),
        shared["o_proj"],
        shared["hc_post"],
        Stage("final_window_commit", ("kv_cache", "gathered_kv", "gathered_slot_mapping"),
              (judged(exact("kv_cache"), kv_check),), _final_window),
    )  # fmt: skip


__all__ = ["key_table", "stages"]
