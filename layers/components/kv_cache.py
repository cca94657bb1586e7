"""The paged KV cache write every attention layer makes before it attends (swa.md §3.4,
csa.md §4.8, hca.md §4.5)."""

from __future__ import annotations

import torch


def write_rows(pool: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """`pool` flat row `slot_mapping[t]` := rows[t] for every token with slot >= 0, in place.

    `pool` is `[pages, page_size, ..., width]`; rows with slot −1 are skipped and no other row
    is touched (swa.md P14). The golden writes the tokens in order, so if two tokens name one
    row the later one wins (the fixtures never do; each layer's `validate` rejects it).
    """
    flat = pool.view(-1, pool.shape[-1])  # a view: writes land in the pool
    writers = torch.nonzero(slot_mapping >= 0).reshape(-1)
    slots = slot_mapping[writers].to(torch.int64)
    unique_slots, inverse = torch.unique(slots, return_inverse=True)
    last = torch.full_like(unique_slots, -1).scatter_reduce(0, inverse, writers, reduce="amax")
    flat[unique_slots] = rows[last].to(flat.dtype)


__all__ = ["write_rows"]
