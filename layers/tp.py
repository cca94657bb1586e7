"""The TP output half on a torch.distributed process group, and the default implementation.

Owns the two collectives of swa.md §5 that every attention layer (SWA, CSA, HCA) shares —
the group all-to-all that hands each rank its LG output groups for all tokens of the TP
group (§5.3) and the reduce-scatter that returns each rank's own tokens (§5.5) — and their
composition with the sharded projection (`layers.output_half`). Collectives run on
`ctx.group` only (never a default group from the environment); at tp == 1 they are
identities and need no process group, so tp = 1 is bitwise the TP1 golden.

`TorchTP` is the implementation under test by default: it dispatches to the layer's own
`forward`.

Shard shapes on rank r of P (t = local_t on every rank, G = o_groups, LG = G/P,
GI = H·HD/G, OL = o_lora_rank, D = hidden_size):

| tensor                  | shape        | dtype | holds                                            |
|-------------------------|--------------|-------|--------------------------------------------------|
| attention_grouped       | [G, t, GI]   | bf16  | rank r's tokens, every group                     |
| attention_local_groups  | [LG, P·t, GI]| bf16  | groups r·LG…, row s·t+i = token i of rank s      |
| wo_a_r                  | [LG, OL, GI] | bf16  | wo_a[r·LG : (r+1)·LG]                            |
| wo_b_r                  | [D, LG·OL]   | int8  | wo_b[:, r·LG·OL : (r+1)·LG·OL]                   |
| wo_b_scale              | [D]          | fp32  | replicated (scale of the full wo_b)              |
| o_partial               | [P·t, D]     | fp32  | every token, rank r's groups only, ·wo_b_scale   |
| o_local (= attn_out)    | [t, D]       | bf16  | rank r's tokens, all groups summed               |
"""

from __future__ import annotations

import torch

from . import output_half
from .base import RankContext
from .numerics import bf16


def group_all_to_all(ctx: RankContext, attention_grouped: torch.Tensor) -> torch.Tensor:
    """`o_group_a2a` (swa.md §5.3): [G, t, GI] bf16 → attention_local_groups [LG, P·t, GI] bf16.

    `out[lg, s·t + i] = attention_grouped_s[r·LG + lg, i]`: compact, source-rank-major (the
    stride is the runtime t, P9). Only the t valid rows of each group are ever sent (P8).
    bf16 travels as its raw bytes (a uint8 view): bit-exact, and accepted by every backend
    (gloo's all_to_all rejects int16, the bit-pattern dtype of validation.md §5.4).

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
    g, t, gi = attention_grouped.shape
    lg = g // p
    send = attention_grouped.reshape(p, lg, t, gi).contiguous().view(torch.uint8)  # [P, LG, t, 2·GI]
    recv = torch.empty_like(send)
    _all_to_all(recv, send, ctx)
    return recv.view(torch.bfloat16).permute(1, 0, 2, 3).reshape(lg, p * t, gi)


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
    u, d = o_partial.shape
    t = u // p
    send = o_partial.reshape(p, t, d).contiguous()
    recv = torch.empty_like(send)
    _all_to_all(recv, send, ctx)
    acc = recv[0].clone()
    # Ascending source rank: the reference's summation order.
    for s in range(1, p):
        acc = acc + recv[s]
    return bf16(acc)


def tp_output_half(
    ctx: RankContext,
    attention_grouped: torch.Tensor,
    wo_a_r: torch.Tensor,
    wo_b_r: torch.Tensor,
    wo_b_scale: torch.Tensor,
) -> torch.Tensor:
    """a2a → sharded projection → reduce-scatter (swa.md §5.1, §6 steps 6–8): attn_out bf16 [t, D].

    | tensor                 | shape          |
    |------------------------|----------------|
    | attention_grouped      | [G, t, GI]     |
    | attention_local_groups | [LG, P·t, GI]  |
    | o_partial              | [P·t, D]       |
    | attn_out               | [t, D]         |
    """
    attention_local_groups = group_all_to_all(ctx, attention_grouped)
    o_partial = output_half.sharded_o_proj(attention_local_groups, wo_a_r, wo_b_r, wo_b_scale)
    return reduce_scatter(ctx, o_partial)


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, ctx: RankContext) -> None:
    if ctx.group is None:
        raise RuntimeError(f"rank {ctx.rank}: tp={ctx.tp} needs a process group in RankContext.group")
    # Imported here: tp == 1 runs (and the goldens) never need torch.distributed.
    import torch.distributed as dist

    dist.all_to_all_single(recv, send, group=ctx.group)


class TorchTP:
    """The default implementation under test: the layer's own torch TP forward."""

    def __call__(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from . import scopes  # here: layers.scopes imports this module

        return scopes.get_scope(ctx.case.layer, ctx.case.scope).forward(ctx, tensors)


__all__ = ["group_all_to_all", "reduce_scatter", "tp_output_half", "TorchTP"]
