"""The keys a run's overrides name: what the user gave explicitly.

Overrides are the command line's `key=value` strings and a sweep job's swept values (Hydra's
`hydra.overrides.task`). A key is named as it is written, without Hydra's `+`, `++` or `~`
prefix: `tp`, `model`, `model.hidden_size`, `tolerance.x_out.diff_thd`.

`renamed_key` refuses a key that was renamed, naming its new name. `unknown_top_level` refuses a key the run config does not have before Hydra composes: Hydra
itself adds any `+key=value` to the config silently (`+layr=swa` would run swa), and refuses a
plain `layr=swa` by suggesting that `+`. `foreign_case_key` refuses a case key of another layer
(`tp` with layer=moe) in the user's words, where the layer's schema would refuse it in Hydra's.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob


def override_keys(overrides: Sequence[str]) -> frozenset[str]:
    return frozenset(o.key_or_group.lstrip("+~") for o in OverridesParser.create().parse_overrides(list(overrides)))


def names(keys: frozenset[str], path: str) -> bool:
    """Whether one of `keys` is `path` or a node above it (`tolerance.x_out` names
    `tolerance.x_out.diff_thd`)."""
    return any(path == k or path.startswith(k + ".") for k in keys)


def unknown_top_level(overrides: Sequence[str], known: Collection[str]) -> str | None:
    """Why one of `overrides` (command-line `key=value` strings, sweeps included) names a top-level
    key or group that is not in `known`, with the nearest known name; None if every one is known.
    A deletion (`~key`) is left to Hydra."""
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        if o.is_delete():
            continue
        top = o.key_or_group.split("/")[0].split(".")[0].split("@")[0]
        if top not in known:
            near = difflib.get_close_matches(top, sorted(known), n=1)
            hint = f"did you mean {near[0]!r}?" if near else "python -m launcher --help lists the keys"
            return f"{text}: {top!r} is not a key of the run config; {hint}"
    return None


def renamed_key(overrides: Sequence[str], renamed: Mapping[str, str]) -> str | None:
    """Why one of `overrides` sets a key that was renamed (`renamed`: old key -> new key),
    naming the new key; None if none does."""
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        key = o.key_or_group.lstrip("+~")
        if key in renamed:
            value = text.split("=", 1)[1] if "=" in text else "..."
            return f"{text}: {key} is now {renamed[key]}; write {renamed[key]}={value}"
    return None


def _layers_chosen(parsed: list, default_layer: str, layers: Collection[str]) -> list[str]:
    """The layers the overrides run: the values of `layer=` (each of a sweep's; a `glob(...)`
    matched against `layers`, as Hydra's config loader would), else the default."""
    for o in parsed:
        if o.key_or_group == "layer" and not o.is_delete():
            if isinstance(o.value(), Glob):
                return o.value().filter(sorted(layers))
            return list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
    return [default_layer]


def foreign_case_key(overrides: Sequence[str], layer_keys: Mapping[str, Collection[str]],
                     default_layer: str) -> str | None:
    """Why one of `overrides` sets a case key that a layer it runs does not take (`tp` of a TP
    layer with layer=moe), naming the layers whose key it is and the keys the layer takes; None if
    every case key it sets belongs to every layer it runs."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    chosen = _layers_chosen(parsed, default_layer, layer_keys)
    case_keys = {k for keys in layer_keys.values() for k in keys}
    for text, o in zip(overrides, parsed):
        key = o.key_or_group.lstrip("+")
        if key not in case_keys or o.is_delete():
            continue
        for layer in chosen:
            takes = layer_keys.get(layer)
            if takes is not None and key not in takes:
                owners = ", ".join(name for name, keys in layer_keys.items() if key in keys)
                return (f"{text} does not apply to layer={layer}: {key} is a key of layer={owners}; "
                        f"layer={layer} takes {', '.join(takes)}")
    return None


__all__ = ["override_keys", "names", "unknown_top_level", "renamed_key", "foreign_case_key"]
