"""Tolerances as configuration: the `tolerance` node read into what one run's checks use.

    tolerance.<tensor>.<param>=value            e.g. tolerance.x_out.diff_thd=4e-3
    tolerance.<tensor>.diagnostic=true          computed and reported, never fails the run
    tolerance.<layer>.<tensor>.<param>=value    only when that layer runs
    tolerance.[<layer>.]multi_rank.<tensor>...  only at tp > 1
    tolerance=<profile>                         configs/tolerance/<profile>.yaml

A parameter is a tolerance of its check (`layers.contract.checks.TOLERANCES`: thresholds,
never mappings, block sizes or sentinels). Profiles are Hydra config group files
(`# @package _global_`), so a profile may set any top-level key too; it names itself in
`tolerance.profile`. Where two entries set one parameter, one the run's overrides name wins,
then the more specific (a layer's section over the top level, multi_rank over neither).

Names are checked against every layer and scope: a tensor no layer or scope compares, or a
parameter no check of that tensor has, is refused with one line listing the valid ones. An
entry for a tensor this run does not compare (another scope's, another layer's) is kept out
and reported as not applied; a parameter this run's check of the tensor lacks is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from layers.contract.checks import Check, tolerance_params
from layers.contract.config import TINY, ConfigError
from layers.registry import LAYERS, PHASES, SCOPES, AnyCase, case_type, get_scope, layer_of

from launcher.config.overrides import names
from launcher.config.schema import layer_groups
from launcher.config.verdict_words import DIAGNOSTIC

PROFILE = "profile"
MULTI_RANK = "multi_rank"


@dataclass(frozen=True)
class Tolerances:
    """What the tolerance config sets for one run's checks."""

    profile: str | None = None
    params: dict[str, dict[str, float]] = field(default_factory=dict)  # tensor -> param -> value
    diagnostic: frozenset[str] = frozenset()
    not_applied: tuple[str, ...] = ()  # entries for tensors this run does not compare

    def apply(self, check: Check) -> tuple[Check, dict[str, dict[str, float]]]:
        """The check with this run's values, and what changed: {param: {"default", "value"}}."""
        values = self.params.get(check.output, {})
        changed = {p: {"default": getattr(check, p), "value": v} for p, v in values.items() if getattr(check, p) != v}
        return (dataclasses.replace(check, **values) if values else check), changed

    def entry(self, checks: tuple[Check, ...]) -> dict[str, Any]:
        """result.json's `tolerance`."""
        overridden = {c.output: self.apply(c)[1] for c in checks}
        return {"profile": self.profile, "overridden": {t: o for t, o in overridden.items() if o},
                "diagnostic": sorted(self.diagnostic), "not_applied": list(self.not_applied)}


@functools.cache
def known_tensors() -> dict[str | None, dict[str, frozenset[str]]]:
    """Tensor -> its tolerance parameters (over every check of it), per layer and (key None)
    over every layer, for every scope the layer runs (its case class's `examples`)."""
    known: dict[str | None, dict[str, set[str]]] = {None: {}}
    groups = layer_groups()
    for layer in LAYERS:
        known[layer] = {}
        kind = case_type(layer, PHASES[0], groups[layer]["key_set"])
        for scope in SCOPES:
            try:
                runs = get_scope(layer, scope)
            except ConfigError:  # a scope this layer does not run
                continue
            for case in kind.examples(layer, TINY, scope):
                for check in runs.checks(case):
                    for key in (None, layer):
                        known[key].setdefault(check.output, set()).update(tolerance_params(check))
    return {k: {t: frozenset(p) for t, p in v.items()} for k, v in known.items()}


def _valid(options) -> str:
    return ", ".join(sorted(options))


def _entries(node: dict, explicit: frozenset[str]):
    """(layer or None, multi_rank, tensor, param, value, key path) of every entry, names checked."""
    known = known_tensors()
    sections = [(None, False, node, "tolerance")]
    for key, value in node.items():
        if key in LAYERS or key == MULTI_RANK:
            if not isinstance(value, dict):
                raise ConfigError(f"tolerance.{key}={value!r} must be a section of tensors")
            layer, multi = (key, False) if key in LAYERS else (None, True)
            sections.append((layer, multi, value, f"tolerance.{key}"))
            if layer and MULTI_RANK in value:
                if not isinstance(value[MULTI_RANK], dict):
                    raise ConfigError(f"tolerance.{key}.{MULTI_RANK}={value[MULTI_RANK]!r} must be a section of tensors")
                sections.append((layer, True, value[MULTI_RANK], f"tolerance.{key}.{MULTI_RANK}"))
    for layer, multi, section, path in sections:
        for tensor, params in section.items():
            if path == "tolerance" and tensor in (*LAYERS, MULTI_RANK, PROFILE) or tensor == MULTI_RANK and layer:
                continue
            valid = known[layer]
            if tensor not in valid:
                who = f"layer {layer} compares no tensor" if layer else "no layer or scope compares a tensor"
                extra = "" if layer or multi else f"; or a section: {_valid(LAYERS)}, {MULTI_RANK}; or {PROFILE}"
                raise ConfigError(f"{path}.{tensor}: {who} named {tensor!r}; valid: {_valid(valid)}{extra}")
            if not isinstance(params, dict):
                raise ConfigError(f"{path}.{tensor}={params!r} must set parameters: {path}.{tensor}.<param>=value")
            for param, value in params.items():
                allowed = valid[tensor] | {DIAGNOSTIC}
                if param not in allowed:
                    raise ConfigError(f"{path}.{tensor}.{param}: {tensor} has no parameter {param!r}; "
                                      f"valid: {_valid(allowed)}")
                key = f"{path}.{tensor}.{param}"
                yield layer, multi, tensor, param, _value(key, param, value), names(explicit, key)


def _value(key: str, param: str, value):
    if param == DIAGNOSTIC:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ConfigError(f"{key}={value!r} must be a number >= 0")
    return value  # an int stays one: labels print max_diff_hd=2 as the reference does


def read_tolerances(node: DictConfig | dict | None, case: AnyCase, explicit: frozenset[str]) -> Tolerances:
    """The tolerances of `case`'s checks from the `tolerance` node; `explicit`: the keys the
    run's overrides name (their entries win)."""
    tree = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    explicit = frozenset(k for k in explicit if k.startswith("tolerance."))  # not `tolerance=<profile>`
    profile = tree.get(PROFILE)
    checks = {c.output: c for c in layer_of(case).checks(case)}
    chosen: dict[tuple[str, str], tuple[tuple, Any]] = {}
    not_applied = set()
    for layer, multi, tensor, param, value, named in _entries(tree, explicit):
        if layer not in (None, case.layer) or multi and case.group_size == 1:
            continue
        where = f"{layer}." if layer else ""
        if tensor not in checks:
            not_applied.add(f"{where}{'multi_rank.' if multi else ''}{tensor}")
            continue
        if param != DIAGNOSTIC and param not in tolerance_params(checks[tensor]):
            raise ConfigError(f"tolerance.{where}{tensor}.{param}: {tensor} is judged by "
                              f"{type(checks[tensor]).__name__} in {case.layer} scope={case.scope}, which has no "
                              f"{param!r}; valid: {_valid(set(tolerance_params(checks[tensor])) | {DIAGNOSTIC})}")
        rank = (named, layer is not None, multi)
        if (tensor, param) not in chosen or rank >= chosen[tensor, param][0]:
            chosen[tensor, param] = (rank, value)
    params: dict[str, dict[str, float]] = {}
    diagnostic = set()
    for (tensor, param), (_, value) in chosen.items():
        if param == DIAGNOSTIC:
            if value:
                diagnostic.add(tensor)
        else:
            params.setdefault(tensor, {})[param] = value
    return Tolerances(profile=None if profile is None else str(profile), params=params,
                      diagnostic=frozenset(diagnostic), not_applied=tuple(sorted(not_applied)))


__all__ = ["Tolerances", "read_tolerances", "known_tensors"]
