"""The TP collectives of the attention layers' output half (swa.md §5, §9.2).

The group all-to-all that hands each rank its LG output groups for all tokens of the TP group
(§5.3), the reduce-scatter that returns each rank's own tokens summed in the reference's order
(§5.5), and the kv token all-gather of the collectives fixture (§9.2). Collectives run on
`ctx.group` only; at tp == 1 they are identities and need no process group, so tp = 1 is
bitwise the TP1 golden.

Shard shapes on rank r of P (t = local_t on every rank, G = o_groups, LG = G/P,
GI = H·HD/G, D = hidden_size):

| tensor                  | shape        | dtype | holds                                            |
|-------------------------|--------------|-------|--------------------------------------------------|
| attention_grouped       | [G, t, GI]   | bf16  | rank r's tokens, every group                     |
| attention_local_groups  | [LG, P·t, GI]| bf16  | groups r·LG…, row s·t+i = token i of rank s      |
| o_partial               | [P·t, D]     | fp32  | every token, rank r's groups only, ·wo_b_scale   |
| o_local (= attn_out)    | [t, D]       | bf16  | rank r's tokens, all groups summed               |
"""

from __future__ import annotations

import torch

from ..components import o_proj
from ..components.numerics import bf16
from ..contract.context import RankContext
from . import wire


def _check_group(ctx: RankContext) -> None:
    if ctx.tp > 1 and ctx.group is None:
        raise RuntimeError(f"rank {ctx.rank}: tp={ctx.tp} needs a process group in RankContext.group")


def group_all_to_all(ctx: RankContext, attention_grouped: torch.Tensor) -> torch.Tensor:
    """`o_group_a2a` (swa.md §5.3): [G, t, GI] bf16 → attention_local_groups [LG, P·t, GI] bf16.

    `out[lg, s·t + i] = attention_grouped_s[r·LG + lg, i]`: compact, source-rank-major (the
    stride is the runtime t, P9). Only the t valid rows of each group are ever sent (P8).

    | tensor            | shape          | holds                                   |
    |-------------------|----------------|-----------------------------------------|
    | attention_grouped | [G, t, GI]     | my tokens, every group                  |
    | send              | [P, LG, t, GI] | block d: groups d·LG … d·LG+LG−1        |
    | recv              | [P, LG, t, GI] | block s: rank s's tokens of my groups   |
    | result            | [LG, P·t, GI]  | row s·t + i: token i of rank s          |
    """
    p = ctx.tp
    if p == 1:
        return attention_grouped
    _check_group(ctx)
    g, t, gi = attention_grouped.shape
    lg = g // p
    recv = wire.all_to_all(attention_grouped.reshape(p, lg, t, gi), ctx.group, p)
    return recv.permute(1, 0, 2, 3).reshape(lg, p * t, gi)


def reduce_scatter(ctx: RankContext, o_partial: torch.Tensor) -> torch.Tensor:
    """`o_proj_reduce_scatter` (swa.md §5.5–5.6): o_partial fp32 [P·t, D] → o_local bf16 [t, D].

    Rows `[o·t, (o+1)·t)` of every rank's partial go to owner o, which sums them in fp32 in
    ascending source-rank order starting from rank 0's — the bit-exact mirror of the
    reference (a backend's reduce_scatter may order a P = 4 sum differently) — and rounds
    once to bf16.

    | tensor    | shape     | holds                                  |
    |-----------|-----------|----------------------------------------|
    | o_partial | [P·t, D]  | block o: owner o's tokens, my groups   |
    | recv      | [P, t, D] | block s: rank s's partial of my tokens |
    | o_local   | [t, D]    | my tokens, all groups                  |
    """
    p = ctx.tp
    if p == 1:
        return bf16(o_partial)
    _check_group(ctx)
    u, d = o_partial.shape
    recv = wire.all_to_all(o_partial.reshape(p, u // p, d), ctx.group, p)
    return bf16(sum_in_rank_order(recv))


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """`parts[0] + parts[1] + ...` in fp32, ascending source rank: the reference's order."""
    acc = parts[0].clone()
    for s in range(1, parts.shape[0]):
        acc = acc + parts[s]
    return acc


def tp_output_half(
    ctx: RankContext, attention_grouped: torch.Tensor, wo_a_r: torch.Tensor, wo_b_r: torch.Tensor,
    wo_b_scale: torch.Tensor,
) -> torch.Tensor:
    """a2a → sharded projection → reduce-scatter (swa.md §5.1, §6 steps 6–8): attn_out bf16 [t, D]."""
    attention_local_groups = group_all_to_all(ctx, attention_grouped)
    o_partial = o_proj.sharded_o_proj(attention_local_groups, wo_a_r, wo_b_r, wo_b_scale)
    return reduce_scatter(ctx, o_partial)


def kv_all_gather(ctx: RankContext, kv_local: torch.Tensor) -> torch.Tensor:
    """The kv token all-gather of §9.2: kv_local [t, D] (valid rows only) → [P·t, D], rank-major."""
    if ctx.tp == 1:
        return kv_local
    _check_group(ctx)
    return wire.all_gather(kv_local, ctx.group, ctx.tp).reshape(ctx.tp * kv_local.shape[0], *kv_local.shape[1:])


__all__ = ["group_all_to_all", "reduce_scatter", "sum_in_rank_order", "tp_output_half", "kv_all_gather"]
