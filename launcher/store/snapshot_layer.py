"""The layer a snapshot holds, from its file names alone (no torch): the config group of its replay.

`golden_data=DIR` alone replays the case DIR holds. Its layer decides the config group the run
composes with (`configs/layer/<name>.yaml`, so which case keys it takes: `golden_data=DIR ep=4`
of a MoE snapshot), so it is read before composing: our manifest.json's `layer`, else what the
tensor names tell (each layer's declared `marks`, `layers.declared`).
`launcher.store.snapshot_case` reads the rest once composed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from layers.contract.declaration import Declaration
from layers.declared import declarations

from launcher.config.overrides import override_keys

MANIFEST = "manifest.json"
SUBDIRS = ("in", "out")

def kind_of(names: set[str]) -> Declaration | None:
    """What tensors named `names` are a snapshot of (a layer or a focused scope), or None."""
    return next((d for d in declarations() if any(n in names for n in d.marks)), None)


def snapshot_layer(directory: str) -> str | None:
    """The layer `directory` holds as its files tell it (None: they do not say); the manifest's
    digest and every shape are checked once the run is composed."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            layer = json.load(f).get("layer")
        if isinstance(layer, str):
            return layer
    except (OSError, ValueError, AttributeError):
        pass
    names = {file[:-3] for sub in SUBDIRS if os.path.isdir(os.path.join(directory, sub))
             for file in os.listdir(os.path.join(directory, sub)) if file.endswith(".pt")}
    kind = kind_of(names)
    return None if kind is None or kind.scope else kind.name


def with_snapshot_layer(overrides: Sequence[str]) -> list[str]:
    """`overrides` with `layer=<the snapshot's>` added where they replay a snapshot (one
    `golden_data=DIR`, no sweep of it) and name no layer."""
    overrides = list(overrides)
    if "layer" in override_keys(overrides):
        return overrides
    given = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("golden_data=")]
    if len(given) != 1 or "," in given[0] or not os.path.isdir(given[0]):
        return overrides
    layer = snapshot_layer(given[0])
    return overrides + [f"layer={layer}"] if layer is not None else overrides


__all__ = ["MANIFEST", "SUBDIRS", "kind_of", "snapshot_layer", "with_snapshot_layer"]
