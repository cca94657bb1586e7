"""Deterministic, rank-addressable random draws for the fixtures.

Every random tensor gets its own generator, seeded from the run seed and a key naming the
tensor (and the rank, or the output group, for per-rank and sharded tensors). A rank can thus
draw exactly its own slice, in any order, without replaying anyone else's stream, and two
processes that ask for the same key get the same bits. Every draw is a fresh tensor, which
the recipes scale in place (`.div_`, `.mul_`): a flash weight has no full-size temporaries.
"""

from __future__ import annotations

import hashlib

import torch


def generator(seed: int, *key: object) -> torch.Generator:
    digest = hashlib.sha256(repr((int(seed),) + tuple(key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def randn(shape, seed: int, *key: object) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator(seed, *key), dtype=torch.float32)


def uniform(shape, low: float, high: float, seed: int, *key: object) -> torch.Tensor:
    t = torch.empty(tuple(shape), dtype=torch.float32)
    return t.uniform_(low, high, generator=generator(seed, *key))
