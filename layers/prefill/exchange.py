"""The projected-KV tail exchange over the CP group (prefill_cp_zigzag.py's tail exchange).

Every rank publishes its two tails `local_kv_tail [2·WIN, HD]` (part 0, then part 1) to every
peer, rank-major (`kv_tail_window` row block 2·rank + part); each rank then reads the blocks
in logical order through `reverse_index`: `logical_tails_out [2cp, WIN, HD]`.
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


__all__ = ["to_logical", "tail_exchange"]
