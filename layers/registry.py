"""Layer lookup by name; each layer module defines `LAYER` and is imported on first use."""

from __future__ import annotations

import importlib

from .contract.config import ConfigError
from .contract.layer import Layer

_MODULES = {"swa": "layers.swa", "csa": "layers.csa", "hca": "layers.hca"}


def layer_names() -> tuple[str, ...]:
    return tuple(_MODULES)


def get_layer(name: str) -> Layer:
    if name not in _MODULES:
        raise ConfigError(f"unknown layer {name!r}; choose one of {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name]).LAYER
