"""The keys a run's overrides name: what the user gave explicitly.

Overrides are the command line's `key=value` strings and a sweep job's swept values (Hydra's
`hydra.overrides.task`). A key is named as it is written, without Hydra's `+`, `++` or `~`
prefix: `tp`, `model`, `model.hidden_size`, `tolerance.x_out.diff_thd`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser


def override_keys(overrides: Sequence[str]) -> frozenset[str]:
    return frozenset(o.key_or_group.lstrip("+~") for o in OverridesParser.create().parse_overrides(list(overrides)))


def names(keys: frozenset[str], path: str) -> bool:
    """Whether one of `keys` is `path` or a node above it (`tolerance.x_out` names
    `tolerance.x_out.diff_thd`)."""
    return any(path == k or path.startswith(k + ".") for k in keys)


__all__ = ["override_keys", "names"]
