"""Every package's snapshot declarations (`layers.contract.declaration`), found by walking the
layer packages for a `declared` module: torch-free, so the launcher reads a snapshot's layer
before it composes (and before anything imports torch). A new layer declares itself in
`layers/<name>/declared.py`; nothing here names it."""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil

import layers

from .contract.declaration import Declaration, in_order


def _declared(attribute: str) -> list[Declaration]:
    """`attribute` of every package's `declared` module that has it, concatenated."""
    found: list[Declaration] = []
    for package in pkgutil.iter_modules(layers.__path__):
        # Looked for on disk: finding a module imports its package, and a package without
        # declarations (the block's) may import torch.
        if package.ispkg and os.path.isfile(os.path.join(package.module_finder.path, package.name, "declared.py")):
            found.extend(getattr(importlib.import_module(f"layers.{package.name}.declared"), attribute, ()))
    return found


@functools.cache
def declarations() -> tuple[Declaration, ...]:
    """Every decode declaration, each before the kinds it shadows (the order snapshots are
    recognised in)."""
    return in_order(_declared("DECLARATIONS"))


@functools.cache
def phase_declarations() -> tuple[Declaration, ...]:
    """The declarations of the other phases' snapshots (`PHASE_DECLARATIONS`), recognised first."""
    return tuple(_declared("PHASE_DECLARATIONS"))


def declaration(name: str) -> Declaration | None:
    return next((d for d in declarations() if d.name == name), None)


__all__ = ["declarations", "declaration", "phase_declarations"]
