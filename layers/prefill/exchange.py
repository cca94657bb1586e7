"""The CP group's two KV exchanges (docs/prefill.md §2).

Zigzag, the tail exchange (prefill_cp_zigzag.py): every rank publishes its two tails
`local_kv_tail [2·WIN, HD]` (part 0, then part 1) to every peer, rank-major (`kv_tail_window`
row block 2·rank + part); each rank then reads the blocks in logical order through
`reverse_index`: `logical_tails_out [2cp, WIN, HD]`.

Contiguous, the replicated-KV all-gather (the dspark tree's prefill_kv_allgather.py): every
rank's projected KV rows `kv [2·tiles·WIN, HD]`, gathered rank-major on every rank:
`gathered_kv [cp·2·tiles·WIN, HD]`.
"""

from __future__ import annotations

import torch

from ..distributed import wire


def to_logical(window: torch.Tensor, reverse_index: torch.Tensor) -> torch.Tensor:
    """Rank-major tails [P, 2·WIN, HD] (or [2P·WIN, HD]) in logical segment order [2P, WIN, HD]."""
    hd = window.shape[-1]
    blocks = window.reshape(reverse_index.numel(), -1, hd)
    return blocks.index_select(0, reverse_index.long())


def tail_exchange(local_kv_tail: torch.Tensor, reverse_index: torch.Tensor, group, world: int) -> torch.Tensor:
    """logical_tails_out [2cp, WIN, HD] from every rank's local_kv_tail [2·WIN, HD]."""
    return to_logical(wire.all_gather(local_kv_tail, group, world), reverse_index)


def kv_allgather(kv: torch.Tensor, group, world: int) -> torch.Tensor:
    """gathered_kv [cp·rows, HD]: every rank's kv [rows, HD], rank r's at row block r."""
    return rank_major(wire.all_gather(kv.contiguous(), group, world))


def rank_major(every_kv: torch.Tensor) -> torch.Tensor:
    """Every rank's rows stacked [P, rows, HD] as one rank-major block [P·rows, HD]."""
    return every_kv.reshape(-1, every_kv.shape[-1])


__all__ = ["to_logical", "tail_exchange", "kv_allgather", "rank_major"]
