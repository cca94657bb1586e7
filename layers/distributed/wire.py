"""Raw-byte collectives: every tensor crosses the wire as its bytes (a uint8 view).

Bytes are bit-exact for every dtype and accepted by every backend (gloo's all_to_all rejects
int16, the bit-pattern dtype of bf16; validation.md §5.4). Each function takes the process
group and world size explicitly, never a default group from the environment; at world size 1
nothing is sent. `torch.distributed` is imported only when something is sent: the goldens and
tp = 1 runs never need it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def all_to_all(send: torch.Tensor, group, world: int) -> torch.Tensor:
    """`send [P, ...]`: block d goes to rank d; returns `recv [P, ...]`, block s from rank s."""
    if world == 1:
        return send
    import torch.distributed as dist

    wire = send.contiguous().view(torch.uint8)  # [P, ..., bytes of the last axis]
    recv = torch.empty_like(wire)
    dist.all_to_all_single(recv, wire, group=group)
    return recv.view(send.dtype).reshape(send.shape)


def all_to_all_v(send: torch.Tensor, send_rows: list[int], recv_rows: list[int], group, world: int) -> torch.Tensor:
    """All-to-all with per-rank row counts (all-to-all-v) on `send [S, ...]`.

    Rows `[Σ send_rows[:d], +send_rows[d])` go to rank d; the result `[Σ recv_rows, ...]`
    holds rank s's rows at `[Σ recv_rows[:s], +recv_rows[s])`. `recv_rows[s]` must be what
    rank s sends here (exchange the counts first). Zero rows to or from any rank, or in
    total, are fine.
    """
    if len(send_rows) != world or len(recv_rows) != world or sum(send_rows) != send.shape[0]:
        raise ValueError(f"all_to_all_v: {world} ranks, send rows {send_rows} for a send buffer of "
                         f"{send.shape[0]} rows, recv rows {recv_rows}")
    if world == 1:
        return send
    import torch.distributed as dist

    row_shape = send.shape[1:]
    row_bytes = _row_bytes(send)
    wire = _bytes(send).reshape(send.shape[0], row_bytes)
    recv = torch.empty((sum(recv_rows), row_bytes), dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(recv, wire, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows),
                           group=group)
    return recv.view(send.dtype).reshape(sum(recv_rows), *row_shape)


def _row_bytes(t: torch.Tensor) -> int:
    n = t.element_size()
    for size in t.shape[1:]:
        n *= size
    return n


def all_gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """Every rank's `t`, stacked `[P, ...]` on `t`'s device (rank-major)."""
    if world == 1:
        return t[None]
    import torch.distributed as dist

    wire = _bytes(t)
    parts = torch.empty((world, wire.numel()), dtype=torch.uint8, device=t.device)
    dist.all_gather(list(parts.unbind(0)), wire, group=group)
    return parts.view(t.dtype).reshape(world, *t.shape)


def gather(t: torch.Tensor, rank: int, world: int, group=None, dst: int = 0) -> torch.Tensor | None:
    """Every rank's `t` stacked `[P, ...]` on rank `dst` (on the CPU); None on the other ranks.

    Rank `dst` receives each rank's bytes straight into its row of one stacked tensor. On gloo
    that takes point-to-point receives: gloo's gather receives into a flat buffer of the same
    size first and copies from it. NCCL's and HCCL's gathers write the rows themselves and
    keep to the group's own communicator (their point-to-point ops would open one per pair).
    Ranks are group ranks; `dst` is translated to its global rank for the point-to-point ops.
    """
    wire = _bytes(t)
    if world == 1:
        return wire.cpu().view(t.dtype).reshape(1, *t.shape)
    import torch.distributed as dist

    stacked = torch.empty((world, wire.numel()), dtype=torch.uint8, device=t.device) if rank == dst else None
    global_dst = _global(group, dst)
    if dist.get_backend(group) != "gloo":
        dist.gather(wire, list(stacked.unbind(0)) if rank == dst else None, dst=global_dst, group=group)
    elif rank != dst:
        dist.send(wire, dst=global_dst, group=group)
    else:
        receives = [dist.irecv(stacked[src], src=_global(group, src), group=group) for src in range(world) if src != dst]
        stacked[dst].copy_(wire)
        for r in receives:
            r.wait()
    if rank != dst:
        return None
    return stacked.cpu().view(t.dtype).reshape(world, *t.shape)


def gather_each(sends: Iterable[tuple[torch.Tensor, int]], rank: int, world: int, group=None) -> list[torch.Tensor | None]:
    """`gather` of several tensors, each to a rank of its own: `sends` yields `(t, dst)` in the
    same order on every rank (the same shapes and dtypes); the answer holds, in that order,
    the stacked `[P, ...]` tensor (CPU) where `dst` is this rank and None elsewhere.

    On gloo every message is posted before any is waited for, so the destinations receive
    side by side; on other backends it is one `gather` after another, each tensor taken from
    `sends` only when its turn comes.
    """
    if world == 1 or _backend(group) != "gloo":
        return [gather(t, rank, world, group, dst) for t, dst in sends]
    import torch.distributed as dist

    stacks, pending, wires = [], [], []  # the wires live until every message is through
    for tag, (t, dst) in enumerate(sends):
        wire = _bytes(t)
        wires.append(wire)
        if rank == dst:
            stacked = torch.empty((world, wire.numel()), dtype=torch.uint8)
            stacked[dst].copy_(wire)
            pending += [dist.irecv(stacked[src], src=_global(group, src), group=group, tag=tag)
                        for src in range(world) if src != dst]
            stacks.append(stacked.view(t.dtype).reshape(world, *t.shape))
        else:
            pending.append(dist.isend(wire, dst=_global(group, dst), group=group, tag=tag))
            stacks.append(None)
    for work in pending:
        work.wait()
    return stacks


def broadcast(t: torch.Tensor | None, shape, dtype: torch.dtype, rank: int, world: int, group=None,
              src: int = 0) -> torch.Tensor:
    """Rank `src`'s tensor `t` (of `shape`, `dtype`; None on the other ranks) on every rank."""
    if world == 1:
        return t
    import torch.distributed as dist

    out = t.contiguous() if rank == src else torch.empty(shape, dtype=dtype)
    wire = out.reshape(-1).view(torch.uint8)
    dist.broadcast(wire, src=_global(group, src), group=group)
    return out


def _backend(group) -> str:
    import torch.distributed as dist

    return dist.get_backend(group)


def _global(group, rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, rank) if group is not None else rank


__all__ = ["all_to_all", "all_to_all_v", "all_gather", "gather", "gather_each", "broadcast"]
