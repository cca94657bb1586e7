"""The HCA CP prefill of the contiguous layout as its stage list: the replicated-KV variant
(docs/prefill.md §11; the SWA variant is layers/prefill/gathered.py).

Each rank projects its contiguous block of the prompt (Q/KV at global positions, the normed
hidden rows) and, from its own rows only, the compressor's per-position state (kv, score +
APE): each row is projected once, by its owner. One all-gather then hands every rank every
rank's projected KV and state rows, rank-major, so every rank holds the whole step: it pools
every 128-position block that ends in the step (a block straddling ranks reads its rows from
the gathered states, positions before the step from its own state pool), commits the
compressed rows and the state of the step's last ≤ 128 positions through its own block
tables, and attends over the window and the compressed rows. No compact exchange: every rank
makes every compressed row itself, so nothing waits on another rank after the one collective.
The O projection, hc_post and the final-window commit are the SWA lists' own stages.
"""

from __future__ import annotations

import torch

from ..components import hca_compressor as comp
from ..contract.checks import AllcloseCheck
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import bf16_close, exact, fp32_close, judged
from . import exchange, gathered, hca, hca_tables, swa
from .case import MAX_SEGMENT_TILES

POSITIONS = hca.POSITIONS


def _compressor_states(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """local_state fp32 [2·tiles·WIN, 2·HD]: (kv, score + APE) of each of the rank's active
    rows at its global position, zero for inactive rows."""
    hd = ctx.model.head_dim
    active = swa.row_mask(v["overlay_active_lengths"], ctx.case.window)
    state = torch.zeros(active.numel(), 2 * hd)
    kv, score = comp.project(v["x_normed"][active], v["cmp_wkv"], v["cmp_wgate"], v["cmp_ape"],
                             v[POSITIONS].reshape(-1)[active])
    state[active] = torch.cat((kv, score), dim=-1)
    return {"local_state": state}


def _kv_allgather(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"gathered_kv": exchange.kv_allgather(v["kv"], ctx.group, ctx.tp),
            "gathered_state": exchange.kv_allgather(v["local_state"], ctx.group, ctx.tp)}


def _kv_allgather_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The same movement from every rank's rows stacked [P, rows, ·]."""
    return {"gathered_kv": exchange.rank_major(v["kv"]), "gathered_state": exchange.rank_major(v["local_state"])}


def _key_table(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return gathered.key_table(ctx, v, POSITIONS)


def step_states(ctx: RankContext, v: Values) -> tuple[torch.Tensor, int, int]:
    """`(states, first, end)`: (kv, score + APE) fp32 [end − first, 2·HD] of positions first …
    end − 1, first = 128 before the step: history from this rank's state pool, the step's from
    the gathered states (position k of segment s is row reverse_index[s]·tiles·WIN + k −
    start_s). The step's end is the case's."""
    hd, sb, win = ctx.model.head_dim, ctx.model.c128_state_block_size, ctx.case.window
    starts = v["segment_starts_t"].long()
    prefix, end = int(starts[0]), ctx.case.prefix + ctx.case.total
    first = max(0, prefix - comp.COMPRESS_RATIO)
    history = torch.arange(first, prefix)
    step = torch.arange(prefix, end)
    segment = torch.searchsorted(starts, step, right=True) - 1
    rows = v["reverse_index"].long()[segment] * MAX_SEGMENT_TILES * win + (step - starts[segment])
    pool = v["compress_state"].view(-1, 2 * hd)[hca_tables.state_rows(v["compress_state_block_table"], history, sb)]
    return torch.cat((pool, v["gathered_state"][rows])), first, end


def _compressor(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """Every block ending in the step pooled on this rank and committed through its own
    cmp_block_table; the state of the step's last ≤ 128 positions through its own
    compress_state_block_table."""
    hd, sb = ctx.model.head_dim, ctx.model.c128_state_block_size
    states, first, end = step_states(ctx, v)
    prefix = int(v["segment_starts_t"][0])
    cmp_kv, state = v["cmp_kv"], v["compress_state"]
    ends = hca_tables.boundaries(prefix, end)
    if ends:
        slots = torch.tensor([(b + 1) // comp.COMPRESS_RATIO - 1 for b in ends])
        cmp_kv.view(-1, hd)[hca_tables.cmp_rows(v["cmp_block_table"], slots)] = hca.compress_part(ctx, v, states,
                                                                                                  first, ends)
    last = torch.arange(max(prefix, end - comp.COMPRESS_RATIO), end)
    state.view(-1, 2 * hd)[hca_tables.state_rows(v["compress_state_block_table"], last, sb)] = states[last - first]
    return {"cmp_kv": cmp_kv, "compress_state": state}


def _window_attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    hd = v["gathered_kv"].shape[-1]
    return hca.attend(ctx, v, torch.cat((v["kv_cache"].reshape(-1, hd), v["gathered_kv"])))


def stages() -> tuple[Stage, ...]:
    _, cmp_check, state_check, _ = hca.default_checks()
    zigzag = {s.name: s for s in hca.stages()}
    shared = {s.name: s for s in gathered.stages()}
    return (
        zigzag["project"],
        Stage("compressor_states", ("x_normed", "cmp_wkv", "cmp_wgate", "cmp_ape", POSITIONS, "overlay_active_lengths"),
              (judged(fp32_close("local_state")),), _compressor_states),
        Stage("kv_allgather", ("kv", "local_state"),
              (judged(exact("gathered_kv"), bf16_close("gathered_kv")),
               judged(exact("gathered_state"), fp32_close("gathered_state"))),
              _kv_allgather, reference=_kv_allgather_reference, every_rank=("kv", "local_state")),
        Stage("gathered_key_table", (POSITIONS, "overlay_active_lengths", "segment_starts_t", "reverse_index",
                                     "kv_cache"), (judged(exact("swa_key_rows")),), _key_table),
        Stage("gathered_compressor", ("gathered_state", "cmp_norm_w", "freqs_cos", "freqs_sin", "segment_starts_t",
                                      "reverse_index", "cmp_kv", "cmp_block_table", "compress_state",
                                      "compress_state_block_table"),
              (judged(exact("cmp_kv"), cmp_check), judged(exact("compress_state"), state_check)), _compressor),
        Stage("window_attention", ("q", "gathered_kv", "kv_cache", "swa_key_rows", "cmp_kv", "cmp_block_table",
                                   POSITIONS, "overlay_active_lengths", "attn_sink"),
              (judged(AllcloseCheck("o", atol=1e-4, rtol=1 / 128)),), _window_attention),
        zigzag["o_proj"],
        zigzag["hc_post"],
        shared["final_window_commit"],
    )  # fmt: skip


__all__ = ["POSITIONS", "step_states", "stages"]
