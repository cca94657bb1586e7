"""Every layer and focused scope by name: what the launcher and the default implementation run."""

from __future__ import annotations

import functools

from .csa import layer as csa
from .hca import layer as hca
from .moe import layer as moe
from .swa import layer as swa
from .block import layer as block
from .moe.collectives import MoECollectivesScope
from .prefill import registry as prefill
from .prefill.case import PrefillCase
from .block.case import BlockCase
from .contract.case import Case, MoECase
from .contract.config import ConfigError
from .contract.layer import Layer
from .attention.scopes import CollectivesScope, OutputScope, TP1Scope

LAYERS = {layer.name: layer for layer in (swa.LAYER, csa.LAYER, hca.LAYER, moe.LAYER, block.LAYER)}
# The layers the focused scopes cut into: the attention layers (their TP output half).
ATTENTION = ("swa", "csa", "hca")
SCOPES = {"full": None, "output": OutputScope, "collectives": CollectivesScope, "tp1": TP1Scope}
# The MoE layer's own focused scopes: its two all-to-alls alone.
MOE_SCOPES = {"collectives": MoECollectivesScope}
# The context-parallel prefill layers (phase=prefill), by layer name.
PREFILL = prefill.PREFILL
# The case each set of case keys builds (`layers.contract.case.CASE_KEYS`, named by a layer's
# config group), and the phases with a case of their own (their keys at the run config's top
# level, `PrefillCase.config_keys`); decode, the first phase, builds its layer's key set's case.
CASE_TYPES = {"tp": Case, "ep": MoECase, "block": BlockCase}
PHASE_CASES = {"prefill": PrefillCase}
PHASES = ("decode", *PHASE_CASES)
# Any layer's case (what a RunSpec carries).
AnyCase = Case | MoECase | BlockCase | PrefillCase


def layer_names() -> tuple[str, ...]:
    return tuple(LAYERS)


def scope_names() -> tuple[str, ...]:
    return tuple(SCOPES)


def get_layer(name: str) -> Layer:
    if name not in LAYERS:
        raise ConfigError(f"unknown layer {name!r}; choose one of {', '.join(LAYERS)}")
    return LAYERS[name]


@functools.cache
def get_scope(layer_name: str, scope: str = "full") -> Layer:
    """The `Layer` that runs `scope` of `layer_name` (one object per pair, so identity is stable)."""
    if scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
    layer = get_layer(layer_name)
    if scope == "full":
        return layer
    if layer_name == moe.LAYER.name:
        if scope not in MOE_SCOPES:
            raise ConfigError(f"scope={scope} is a part of an attention layer's TP step; layer=moe runs scope=full "
                              f"or {', '.join(MOE_SCOPES)}")
        return MOE_SCOPES[scope]()
    if layer_name not in ATTENTION:
        raise ConfigError(f"scope={scope} is a part of an attention layer's TP step; layer={layer_name} runs scope=full")
    return SCOPES[scope](layer)


def prefill_layer(name: str) -> Layer:
    if name not in PREFILL:
        raise ConfigError(f"phase=prefill runs layer={'|'.join(PREFILL)}; layer={name} has no prefill stage list")
    return PREFILL[name]


def case_type(layer: str, phase: str, key_set: str) -> type:
    """The case class a run of `layer` in `phase` builds, its config group naming case keys
    `key_set`: the phase's own (for a layer that runs that phase), else the key set's."""
    if phase not in PHASES:
        raise ConfigError(f"phase={phase!r} must be one of {', '.join(PHASES)}")
    if phase in PHASE_CASES:
        prefill_layer(layer)  # a layer without a prefill stage list is a ConfigError here
        return PHASE_CASES[phase]
    return CASE_TYPES[key_set]


def layer_of(case, scope: str | None = None) -> Layer:
    """The layer (or focused scope) a case runs: its phase's, by name and scope (`scope`: in
    place of the case's own)."""
    if isinstance(case, PrefillCase):
        prefill_layer(case.layer)  # a layer without a prefill stage list is a ConfigError
        return prefill.of_case(case, scope)
    return get_scope(case.layer, case.scope if scope is None else scope)


def validated(case) -> Layer:
    """The layer (or scope) of `case` once the case passed every check: the TP-level rules all
    layers share (`Case.validate`), then the layer's own. The one validation of a case."""
    layer = layer_of(case)
    if isinstance(case, PrefillCase):
        layer.validate(case)
        return layer
    if isinstance(case, Case):
        case.validate(layer.whole_requests)
    else:  # the MoE and block cases: their EP rules
        case.validate()
    layer.validate(case)
    return layer


__all__ = ["LAYERS", "SCOPES", "PREFILL", "PHASES", "CASE_TYPES", "PHASE_CASES", "AnyCase", "case_type", "prefill_layer", "layer_of", "layer_names", "scope_names", "get_layer", "get_scope", "validated"]
