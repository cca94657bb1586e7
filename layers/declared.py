"""Every package's snapshot declarations (`layers.contract.declaration`), found by walking the
layer packages for a `declared` module: torch-free, so the launcher reads a snapshot's layer
before it composes (and before anything imports torch). A new layer declares itself in
`layers/<name>/declared.py`; nothing here names it."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil

import layers

from .contract.declaration import Declaration, in_order


@functools.cache
def declarations() -> tuple[Declaration, ...]:
    """Every declaration, each before the kinds it shadows (the order snapshots are recognised in)."""
    found: list[Declaration] = []
    for package in pkgutil.iter_modules(layers.__path__):
        name = f"layers.{package.name}.declared"
        if package.ispkg and importlib.util.find_spec(name) is not None:
            found.extend(importlib.import_module(name).DECLARATIONS)
    return in_order(found)


def declaration(name: str) -> Declaration | None:
    return next((d for d in declarations() if d.name == name), None)


__all__ = ["declarations", "declaration"]
