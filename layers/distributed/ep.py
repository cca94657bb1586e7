"""The expert-parallel collectives of the MoE layer (moe.md §3.1–3.2, §13.2).

The count exchange (`recv_meta`), the dispatch all-to-all-v of the routes' int8 rows with
their token scale, routing weight and route id, and the combine all-to-all-v of the routed
outputs back to their sources with the splits swapped. Collectives run on `ctx.group` only,
through the raw-byte wire (`layers.distributed.wire`: gloo has no int8/bf16 all-to-all-v on
every build, bytes cross any backend bit for bit); at ep = 1 they are identities and need no
process group. Empty splits (num_tokens = 0, an expert nobody routes to) are ordinary.

Shapes on rank r of P (L local experts, K slots, D hidden; S routes sent, R received):

| tensor       | shape     | dtype | holds                                                               |
|--------------|-----------|-------|---------------------------------------------------------------------|
| send_meta    | [P, L]    | int32 | row d: my routes to each of rank d's experts                         |
| send_route   | [S]       | int32 | my route ids ρ = t·K + k in send order (d, e, ρ)                     |
| payload      | [S, D+12] | uint8 | per route: x_norm_i8[t] (D bytes), x_norm_scale[t], weights[t, k] (fp32), ρ (int32) |
| recv_meta    | [P, L]    | int32 | row s: rank s's routes to each of my experts                         |
| recv_x       | [R, D]    | int8  | received rows, expert-major, then source, then ρ (§3.1 step 3)      |
| recv_aux     | [R, 2]    | fp32  | column 0 token dequant scale, column 1 routing weight               |
| recv_route   | [R]       | int32 | the route id each row carries (its source's ρ)                       |
| recv_y       | [R, D]    | bf16  | the routed outputs, rows as recv_x                                   |
| routed_y_buf | [T·K, D]  | bf16  | row ρ: my route ρ's output; rows of inactive tokens stay 0          |
"""

from __future__ import annotations

import torch

from ..components.moe_routing import block_transpose
from ..contract.context import RankContext
from . import wire

# Bytes a route carries besides its D int8 codes: token scale and routing weight (fp32), route id (int32).
_AUX_BYTES = 12


def _world(ctx: RankContext) -> int:
    p = ctx.case.ep
    if p > 1 and ctx.group is None:
        raise RuntimeError(f"rank {ctx.rank}: ep={p} needs a process group in RankContext.group")
    return p


def _row_counts(meta: torch.Tensor) -> list[int]:
    return [int(c) for c in meta.sum(dim=1).tolist()]


def count_exchange(ctx: RankContext, send_meta: torch.Tensor) -> torch.Tensor:
    """§3.1 step 1: my row d of counts goes to rank d; recv_meta [P, L] row s is rank s's row for me."""
    return wire.all_to_all(send_meta.contiguous(), ctx.group, _world(ctx))


def dispatch(
    ctx: RankContext, x_norm_i8: torch.Tensor, x_norm_scale: torch.Tensor, weights: torch.Tensor,
    send_meta: torch.Tensor, send_route: torch.Tensor, recv_meta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§3.1 step 2–3: every route's row to its expert's rank → `(recv_x, recv_aux, recv_route)`.

    One byte-packed all-to-all-v: rank d gets `send_meta[d].sum()` rows from me, source-major
    with each source's rows in (e, ρ) order; the (source, expert) blocks are then transposed
    to expert-major, so expert e's rows are its sources' lanes in ascending source order.
    """
    k = weights.shape[1]
    d = x_norm_i8.shape[1]
    rho = send_route.long()
    tok = rho // k
    payload = torch.cat(
        (
            x_norm_i8[tok].view(torch.uint8),
            x_norm_scale[tok].reshape(-1, 1).contiguous().view(torch.uint8),
            weights.reshape(-1)[rho].reshape(-1, 1).contiguous().view(torch.uint8),
            send_route.to(torch.int32).reshape(-1, 1).contiguous().view(torch.uint8),
        ),
        dim=1,
    )  # [S, D + 12]
    recv = wire.all_to_all_v(payload, _row_counts(send_meta), _row_counts(recv_meta), ctx.group, _world(ctx))
    recv = recv[block_transpose(recv_meta)]  # source-major → expert-major
    recv_x = recv[:, :d].contiguous().view(torch.int8)
    recv_aux = recv[:, d : d + 8].contiguous().view(torch.float32)  # [R, 2]
    recv_route = recv[:, d + 8 : d + _AUX_BYTES].contiguous().view(torch.int32).reshape(-1)
    return recv_x, recv_aux, recv_route


def combine(
    ctx: RankContext, recv_y: torch.Tensor, recv_meta: torch.Tensor, send_meta: torch.Tensor,
    send_route: torch.Tensor, tokens: int, experts_per_tok: int,
) -> torch.Tensor:
    """§3.2: every routed output back to its source → routed_y_buf [T·K, D] bf16.

    The inverse all-to-all-v: rows back to source s are `recv_meta[s].sum()` (the dispatch's
    receive split is now the send split and vice versa). The expert-major rows are regrouped
    source-major first; each source then receives its rows in its own send order and puts
    row j at routed_y_buf[send_route[j]].
    """
    back = recv_y[block_transpose(recv_meta.t())]  # expert-major → source-major
    rows = wire.all_to_all_v(back, _row_counts(recv_meta), _row_counts(send_meta), ctx.group, _world(ctx))
    routed_y_buf = torch.zeros(tokens * experts_per_tok, recv_y.shape[1], dtype=torch.bfloat16, device=recv_y.device)
    routed_y_buf[send_route.long()] = rows
    return routed_y_buf


__all__ = ["count_exchange", "dispatch", "combine"]
