"""What a layer (or a focused scope) declares of its snapshots, torch-free: the launcher reads a
snapshot's layer, group size, case scalars and model dims through these declarations alone.

Each layer package declares one in its `declared` module (`layers.declared` collects them before
anything imports torch: the launcher reads a snapshot's layer from its file names to choose the
config group it composes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# A model field's value from a file's rank-stacked shape, the group size and the fields read so far.
Derive = Callable[[tuple, int, dict], int]


@dataclass(frozen=True)
class Dim:
    """How one model field shows in a snapshot's tensors: the files that fix it (`in/x_hc`, the
    first present wins) and the axis of their rank-stacked shape (axis 0 is the rank), or a
    `derive` for a field that is a product or quotient of axes."""

    field: str
    files: tuple[str, ...]
    axis: int = 0
    derive: Derive | None = None

    def value(self, shape: tuple, group: int, fields: dict) -> int:
        return self.derive(shape, group, fields) if self.derive else shape[self.axis]


@dataclass(frozen=True)
class Declaration:
    """One layer's or focused scope's snapshot facts.

    `marks`: tensor names whose presence tells a snapshot holds it. `shadows`: the kinds whose
    marks its snapshots hold too (it is recognised before them). `group_key`: the case key the
    files' leading axis gives (tp, ep). `anchors`: the files to cite for it, first present.
    `scalars`: case keys each stored as a 0-dim int32 file `in/<key>.pt`; `case_dims`: where
    the tensor shapes fix those when the file is missing. `dims`: the model fields its tensor
    shapes fix, in dependency order. `scope`: a focused scope of the attention
    layers (no layer of its own), not a layer. `phase`: a snapshot of that phase (not decode),
    recognised before every decode kind when it holds every one of its marks; `name` is then
    the layer such a snapshot runs when its manifest names none."""

    name: str
    marks: tuple[str, ...]
    dims: tuple[Dim, ...]
    group_key: str = "tp"
    anchors: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()
    case_dims: tuple[Dim, ...] = ()
    shadows: tuple[str, ...] = ()
    scope: bool = False
    phase: str | None = None


def in_order(declarations: list[Declaration]) -> tuple[Declaration, ...]:
    """`declarations` so that each comes before every kind it shadows (recognition order)."""
    by_name = {d.name: d for d in declarations}
    ordered: list[Declaration] = []

    def visit(d: Declaration, path: tuple[str, ...]) -> None:
        if d in ordered:
            return
        if d.name in path:
            raise ValueError(f"declarations shadow each other in a cycle: {' -> '.join((*path, d.name))}")
        for other in declarations:  # every kind that shadows d goes first
            if d.name in other.shadows:
                visit(other, (*path, d.name))
        ordered.append(d)

    for d in sorted(by_name.values(), key=lambda d: d.name):
        visit(d, ())
    return tuple(ordered)


__all__ = ["Derive", "Dim", "Declaration", "in_order"]
