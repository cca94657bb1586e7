"""Every layer and focused scope by name: what the launcher and the default implementation run.

Importing this module imports no torch: the names, the case each layer builds and a case's own
rules (`check_case`) are read without the layers' compute, so the launcher refuses a config
before it pays for torch. A layer's compute module (`layers.<name>.layer`) is imported when its
`Layer` is first asked for (`get_layer`, `get_scope`, `layer_of`)."""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from .prefill.case import PrefillCase
from .block.case import BlockCase
from .contract.case import Case, MoECase
from .contract.config import ConfigError

if TYPE_CHECKING:
    from .contract.layer import Layer

LAYERS = ("swa", "csa", "hca", "moe", "block")
# The layers the focused scopes cut into: the attention layers (their TP output half).
ATTENTION = ("swa", "csa", "hca")
# Each focused scope of an attention layer: the class that runs it, in `layers.attention.scopes`.
SCOPES = {"full": None, "output": "OutputScope", "collectives": "CollectivesScope", "tp1": "TP1Scope"}
# The scopes whose tokens are rows of a buffer, not whole requests (`Case.validate`).
ROW_SCOPES = ("output", "collectives")
# The MoE layer's own focused scopes (its two all-to-alls alone), in `layers.moe.collectives`.
MOE_SCOPES = {"collectives": "MoECollectivesScope"}
# The layers with a context-parallel prefill stage list (phase=prefill: `layers.prefill.registry`).
PREFILL = ("swa", "hca", "csa")
# The case each set of case keys builds (`layers.contract.case.CASE_KEYS`, named by a layer's
# config group), and the phases with a case of their own (their keys at the run config's top
# level, `PrefillCase.config_keys`); decode, the first phase, builds its layer's key set's case.
CASE_TYPES = {"tp": Case, "ep": MoECase, "block": BlockCase}
PHASE_CASES = {"prefill": PrefillCase}
PHASES = ("decode", *PHASE_CASES)
# Any layer's case (what a RunSpec carries).
AnyCase = Case | MoECase | BlockCase | PrefillCase


def layer_names() -> tuple[str, ...]:
    return LAYERS


def scope_names() -> tuple[str, ...]:
    return tuple(SCOPES)


def get_layer(name: str) -> Layer:
    if name not in LAYERS:
        raise ConfigError(f"unknown layer {name!r}; choose one of {', '.join(LAYERS)}")
    return importlib.import_module(f"layers.{name}.layer").LAYER


def check_scope(layer_name: str, scope: str = "full") -> None:
    """Raise ConfigError unless `layer_name` runs `scope`."""
    if scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
    if layer_name not in LAYERS:
        raise ConfigError(f"unknown layer {layer_name!r}; choose one of {', '.join(LAYERS)}")
    if scope == "full":
        return
    if layer_name == "moe":
        if scope not in MOE_SCOPES:
            raise ConfigError(f"scope={scope} is a part of an attention layer's TP step; layer=moe runs scope=full "
                              f"or {', '.join(MOE_SCOPES)}")
        return
    if layer_name not in ATTENTION:
        raise ConfigError(f"scope={scope} is a part of an attention layer's TP step; layer={layer_name} runs scope=full")


def whole_requests(layer_name: str, scope: str = "full") -> bool:
    """Whether a case's local_t is whole requests in whole 8-row tiles (a layer), or any count of
    a buffer's rows in [1, capacity] (an attention layer's output and collectives scopes)."""
    return not (layer_name in ATTENTION and scope in ROW_SCOPES)


@functools.cache
def get_scope(layer_name: str, scope: str = "full") -> Layer:
    """The `Layer` that runs `scope` of `layer_name` (one object per pair, so identity is stable)."""
    check_scope(layer_name, scope)
    layer = get_layer(layer_name)
    if scope == "full":
        return layer
    if layer_name == "moe":
        return getattr(importlib.import_module("layers.moe.collectives"), MOE_SCOPES[scope])()
    return getattr(importlib.import_module("layers.attention.scopes"), SCOPES[scope])(layer)


def check_prefill_layer(name: str) -> None:
    if name not in PREFILL:
        raise ConfigError(f"phase=prefill runs layer={'|'.join(PREFILL)}; layer={name} has no prefill stage list")


def case_type(layer: str, phase: str, key_set: str) -> type:
    """The case class a run of `layer` in `phase` builds, its config group naming case keys
    `key_set`: the phase's own (for a layer that runs that phase), else the key set's."""
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r} must be one of {', '.join(PHASES)}")
    if phase in PHASE_CASES:
        check_prefill_layer(layer)
        return PHASE_CASES[phase]
    return CASE_TYPES[key_set]


def layer_of(case, scope: str | None = None) -> Layer:
    """The layer (or focused scope) a case runs: its phase's, by name and scope (`scope`: in
    place of the case's own)."""
    if isinstance(case, PrefillCase):
        check_prefill_layer(case.layer)
        return importlib.import_module("layers.prefill.registry").of_case(case, scope)
    return get_scope(case.layer, case.scope if scope is None else scope)


def check_case(case) -> None:
    """The rules a case states of itself, torch-free: its layer and scope by name, then its TP
    rules (`Case.validate`), EP rules (the MoE and block cases) or CP rules (the prefill case).
    What the launcher refuses a config with before it imports any layer's compute."""
    if isinstance(case, PrefillCase):
        check_prefill_layer(case.layer)
        case.validate()
        return
    check_scope(case.layer, case.scope)
    if isinstance(case, Case):
        case.validate(whole_requests(case.layer, case.scope))
    else:
        case.validate()


def validated(case) -> Layer:
    """The layer (or scope) of `case` once the case passed every check: its own rules
    (`check_case`), then its layer's, which read the layer's fixtures. The one validation of a case."""
    check_case(case)
    layer = layer_of(case)
    layer.validate(case)
    return layer


__all__ = ["LAYERS", "SCOPES", "PREFILL", "PHASES", "CASE_TYPES", "PHASE_CASES", "AnyCase", "case_type", "check_case",
           "check_prefill_layer", "check_scope", "layer_of", "layer_names", "scope_names",
           "get_layer", "get_scope", "validated", "whole_requests"]
