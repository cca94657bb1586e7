"""Where the MoE layer's routes go between ranks: the layouts of dispatch and combine (moe.md §3.1–3.2, §4.4, §4.6).

A route is one (token t, slot k) of a source rank with t < n; its id is ρ = t·K + k and its
global expert eid = indices[t, k] lives on rank eid // L as local expert eid % L. Two
independent descriptions of the same layout, so that the expert-parallel forward and the
golden never share a bug:

* the forward's, as index arithmetic on counts (`send_layout`, `block_transpose`): the
  source orders its send rows by (dst, e, ρ); the destination receives them source-major and
  transposes the (source, expert) blocks to expert-major; the combine transposes back;
* the golden's replay (`replay_dispatch`, `replay_combine`), spelled as §4.4 states it: for
  each destination expert, the routes of every source with that expert, source ascending,
  then ρ ascending.

Pure index math on one process; no collectives (those are `layers.distributed.ep`).

Layouts on rank r of P (L local experts, K slots, n active tokens, S routes sent, R received):

| tensor       | shape    | dtype | holds                                                                 |
|--------------|----------|-------|-----------------------------------------------------------------------|
| send_meta    | [P, L]   | int32 | row dst: how many of my routes go to each of dst's experts (cnt[r][dst]) |
| send_route   | [S]      | int32 | my route ids in send order: dst, then local expert, then ρ ascending   |
| recv_meta    | [P, L]   | int32 | row src: how many routes src sends to each of my experts             |
| recv_route   | [R]      | int32 | route ids as received, expert-major, then source, then ρ (§3.1 step 3) |
| routed_y_buf | [T·K, D] | bf16  | row ρ: the routed output of my route ρ (rows of inactive tokens unused) |
"""

from __future__ import annotations

import torch

from .moe import active_tokens


def _check_expert_ids(eid: torch.Tensor, experts: int) -> None:
    if eid.numel() and (int(eid.min()) < 0 or int(eid.max()) >= experts):
        raise ValueError(f"expert ids must be in [0, {experts}); got [{int(eid.min())}, {int(eid.max())}]")


# -- the forward's layout ----------------------------------------------------------------------
def send_layout(indices: torch.Tensor, num_tokens: int, ep: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(send_meta [P, L] int32, send_route [S] int32)` of one source (§3.1 steps 1–2, §13.2).

    Only the n active tokens route. Sorting the flat routes by eid = dst·L + e, stably, gives
    the send order dst-major, then local expert, then ρ (token-major, slot-minor): the slot
    order of every (dst, e) lane of §3.1.
    """
    t, _k = indices.shape
    n = active_tokens(num_tokens, t)
    eid = indices[:n].reshape(-1).long()  # position ρ = t·K + k
    _check_expert_ids(eid, ep * local_experts)
    send_route = torch.argsort(eid, stable=True).to(torch.int32)
    send_meta = torch.bincount(eid, minlength=ep * local_experts).reshape(ep, local_experts).to(torch.int32)
    return send_meta, send_route


def block_transpose(counts: torch.Tensor) -> torch.Tensor:
    """Gather index turning rows laid out in blocks (a, b), a-major, into b-major order.

    counts [A, B]: block (a, b) holds counts[a, b] consecutive rows; blocks are stored
    (0, 0), (0, 1), …, (1, 0), …. `rows[block_transpose(counts)]` stores them (0, 0), (1, 0),
    …, (0, 1), … with every block's own rows in their order. Dispatch receive: counts =
    recv_meta (source-major → expert-major); combine send: counts = recv_meta.T (back).
    """
    c = counts.to(torch.int64)
    a, b = c.shape
    flat = c.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(a, b).t().reshape(-1)  # a-major starts, listed b-major
    counts_t = c.t().reshape(-1)
    out_starts = torch.cumsum(counts_t, 0) - counts_t
    total = int(flat.sum())
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(starts - out_starts, counts_t)


# -- the golden's replay (§4.4, §4.6) ------------------------------------------------------------
def replay_dispatch(
    dst: int, indices: torch.Tensor, num_tokens: int, local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routes destination `dst` receives, from every source's indices [P, T, K] (§4.4).

    Returns `(recv_meta [P, L] int32, route_src [R] int64, route_id [R] int64)`: row j of
    local expert e's list is the j-th route (s, ρ) with indices_s[ρ] = dst·L + e and t < n,
    ordered by s, then ρ; the experts' lists are concatenated in e order.
    """
    p, t, k = indices.shape
    n = active_tokens(num_tokens, t)
    flat = indices[:, :n].reshape(p, n * k).long()
    recv_meta = torch.zeros(p, local_experts, dtype=torch.int32)
    srcs, ids = [], []
    for e in range(local_experts):
        src, rho = torch.nonzero(flat == dst * local_experts + e, as_tuple=True)  # row-major: s, then ρ
        srcs.append(src)
        ids.append(rho)
        recv_meta[:, e] = torch.bincount(src, minlength=p)
    return recv_meta, torch.cat(srcs), torch.cat(ids)


def replay_combine(
    src: int, tokens: int, experts_per_tok: int, replays: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    recv_ys: list[torch.Tensor],
) -> torch.Tensor:
    """Source `src`'s routed_y_buf [T·K, D] bf16 from every destination's routed rows (§4.6, §3.2).

    `replays[d]` is `replay_dispatch(d, …)`, `recv_ys[d]` destination d's recv_y [R_d, D]
    (rows in the replay's order). Row ρ of the result is the row of src's route ρ; rows of
    inactive tokens stay zero (never read by the reduce).
    """
    d_model = recv_ys[0].shape[1]
    buf = torch.zeros(tokens * experts_per_tok, d_model, dtype=torch.bfloat16)
    for (_meta, route_src, route_id), recv_y in zip(replays, recv_ys):
        mine = route_src == src
        buf[route_id[mine]] = recv_y[: route_src.numel()][mine]
    return buf


__all__ = ["send_layout", "block_transpose", "replay_dispatch", "replay_combine"]
