"""Which faults a config may ask for: `fault.kind=K fault.rank=R fault.phase=P` (`Fault`).

A fault that could never fire is refused before any rank starts: a smoke test expecting it must
not pass silently. Firing it is the ranks' business (`launcher.run.fault_injection`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from layers.contract.config import ConfigError

from launcher.config.rank_phases import FAULT_PHASES

KINDS = ("raise", "exit", "hang", "nan", "corrupt")
OUTPUT_KINDS = ("nan", "corrupt")  # faults in the implementation's outputs, not in the process


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    phase: str  # a rank phase (`launcher.config.rank_phases`)

    def check(self, tp: int, absent: Mapping[str, str]) -> None:
        """Refuse a fault that could never fire: a smoke test expecting it must not pass silently.
        `absent`: the rank phases this run does not have, each with the key that would add it."""
        if self.kind not in KINDS:
            raise ConfigError(f"fault.kind={self.kind!r} must be one of {', '.join(KINDS)}")
        if self.phase not in FAULT_PHASES:
            raise ConfigError(f"fault.phase={self.phase!r} must be one of {', '.join(FAULT_PHASES)}")
        if not 0 <= self.rank < tp:
            raise ConfigError(f"fault.rank={self.rank} must be in [0, {tp}) for tp={tp}")
        if self.kind in OUTPUT_KINDS and self.phase != "layer":
            raise ConfigError(f"fault.kind={self.kind} corrupts the layer's outputs: it needs fault.phase=layer")
        if self.phase in absent:
            raise ConfigError(f"fault.phase={self.phase} never runs without {absent[self.phase]}")


def check_unset(rank: int, phase: str, tp: int) -> None:
    """Without fault.kind nothing fires, but the rank and phase must still exist: a sweep over
    `fault.kind=null,hang fault.rank=1` runs both, and a typo must not pass silently."""
    if phase not in FAULT_PHASES:
        raise ConfigError(f"fault.phase={phase!r} must be one of {', '.join(FAULT_PHASES)}")
    if not 0 <= rank < tp:
        raise ConfigError(f"fault.rank={rank} must be in [0, {tp}) for tp={tp}")
