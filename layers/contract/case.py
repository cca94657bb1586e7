"""The description of one validated decode step: layer, model, TP size, tokens, seed, starts.

`Case` is what every rank, the golden and the snapshot manifest agree on. Its checks are the
TP-level rules shared by all layers (spec swa.md §1.4, csa.md §1.5, hca.md §2.3); each layer
adds its own (start-position ceilings, pool capacity) in `Layer.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ConfigError, ModelConfig, round_up

# Token counts are whole 8-row tiles (the reference's BIAS_T_TILE / VALID_TOKEN_TILE).
TOKEN_TILE = 8


@dataclass(frozen=True)
class Case:
    layer: str
    model: ModelConfig
    tp: int
    local_t: int
    seed: int
    # None: the layer's canonical start set; an int: every request; a tuple: one start per
    # request of this rank (length batch) or of the whole TP group (length tp * batch).
    start_pos: int | tuple[int, ...] | None = None
    # What the run validates: the whole layer, or one of the focused scopes (layers.scopes).
    scope: str = "full"

    @property
    def seq(self) -> int:
        return self.model.decode_seq

    @property
    def capacity(self) -> int:
        """Token capacity of one rank (LOCAL_T)."""
        return self.model.decode_tokens // self.tp

    @property
    def batch(self) -> int:
        """Requests on one rank."""
        return self.local_t // self.seq

    @property
    def group_batch(self) -> int:
        """Requests of the whole TP group."""
        return self.tp * self.batch

    @property
    def local_o_groups(self) -> int:
        return self.model.o_groups // self.tp

    @property
    def local_t_pad(self) -> int:
        return round_up(self.capacity, 16)

    def validate(self) -> None:
        m, tp, t = self.model, self.tp, self.local_t
        if tp < 1:
            raise ConfigError(f"tp={tp} must be >= 1")
        if m.o_groups % tp:
            raise ConfigError(f"tp={tp} must divide o_groups={m.o_groups} of model {m.name!r} (each rank owns whole output groups)")
        if m.decode_batch % tp:
            raise ConfigError(f"tp={tp} must divide the decode batch {m.decode_batch} of model {m.name!r}")
        cap = self.capacity
        step = row_block(m)
        if not (TOKEN_TILE <= t <= cap) or t % step:
            raise ConfigError(
                f"local_t={t} must be a multiple of {step} (token tile {TOKEN_TILE} and decode seq {self.seq}) "
                f"in [{TOKEN_TILE}, {cap}] (the rank capacity decode_batch*decode_seq/tp = {m.decode_tokens}/{tp}) "
                f"for model {m.name!r}"
            )

    def starts_for_rank(self, rank: int, canonical: list[int]) -> list[int]:
        """The start positions of `rank`'s requests (the spec's resolve rules, per rank)."""
        b = self.batch
        sp = self.start_pos
        if sp is None:
            return list(canonical)
        if isinstance(sp, int):
            return [sp] * b
        sp = list(sp)
        if len(sp) == b:
            return sp
        if len(sp) == self.tp * b:
            return sp[rank * b : (rank + 1) * b]
        raise ConfigError(
            f"start_pos has {len(sp)} entries; expected one per request of a rank ({b}) "
            f"or of the TP group ({self.tp * b})"
        )

    def check_starts(self, starts: list[int], max_seq_len: int) -> None:
        for s in starts:
            if s < 0:
                raise ConfigError(f"start_pos={s}: decode start positions must be non-negative")
            if s + self.seq > max_seq_len:
                raise ConfigError(
                    f"start_pos={s}: start + decode_seq ({self.seq}) must be <= the context ceiling {max_seq_len}"
                )


def row_block(model: ModelConfig) -> int:
    """Tokens of one row block: whole requests in whole 8-row token tiles, lcm(8, decode_seq)."""
    return math.lcm(TOKEN_TILE, model.decode_seq)
