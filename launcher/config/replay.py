"""The case a replayed snapshot fixes, merged with the keys the command line gives.

A snapshot holds its whole case: `launcher.store.snapshot_case.describe` reads what it says
(layer, scope, seed, model and the keys its case class names, `snapshot_keys`: tp, local_t
and start positions of a TP layer) into `SnapshotFacts`, each fact with
the file it comes from. `replayed_case` takes every fact in place of the config's value; a key
the user gave explicitly must agree with the snapshot, or the run is refused with one line
naming the key, both values and the file. Keys the snapshot does not fix (a scope snapshot's
layer) keep the config's value, except the seed: a snapshot that records none (the
reference's) gives every input, so no seed plays a part and the case's seed is None, shown as
`seed=-`, never the config's default as if it were the snapshot's.

A key is given explicitly when it is one of the run's overrides (the command line, a sweep's
parameters; `given_keys`), and `local_t` / `start_pos` also when a config group set them to
anything but null (`+tokens=...`, `+starts=...`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from layers.contract.config import ConfigError, ModelConfig
from layers.registry import CASE_TYPES, PHASE_CASES, AnyCase, get_scope, whole_requests

from launcher.config.overrides import override_keys

if TYPE_CHECKING:
    from layers.contract.layer import Layer

# The keys a snapshot can fix (each case class's `snapshot_keys`); `model.<field>` keys are read
# as the model key too.
CASE_KEYS = tuple(dict.fromkeys(("layer", "phase", "scope",
                                 *(k for kind in (*CASE_TYPES.values(), *PHASE_CASES.values()) for k in kind.snapshot_keys),
                                 "seed", "model")))


@dataclass(frozen=True)
class Fact:
    """One thing a snapshot says about its case, and the file that says it."""

    value: Any
    source: str
    how: str = ""  # how the file says it, e.g. "its leading axis"


@dataclass(frozen=True)
class SnapshotFacts:
    """What one snapshot fixes of its case (None: it does not say)."""

    directory: str
    layer: Fact | None = None
    scope: Fact | None = None
    tp: Fact | None = None
    local_t: Fact | None = None
    starts: Fact | None = None  # value: every rank's request starts, tuple per rank
    ep: Fact | None = None
    layer_id: Fact | None = None
    num_tokens: Fact | None = None
    phase: Fact | None = None  # a CP prefill snapshot (layers/prefill) says prefill
    cp: Fact | None = None
    cp_layout: Fact | None = None
    prefix: Fact | None = None
    segment_lens: Fact | None = None
    seed: Fact | None = None
    model: ModelConfig | None = None  # the model its dims select (a preset, or one named "snapshot")
    model_fields: dict[str, Fact] = field(default_factory=dict)  # every field it fixes

    def get(self, key: str) -> Fact | None:
        return getattr(self, "starts" if key == "start_pos" else key)


def given_keys(cfg: DictConfig, overrides: Sequence[str] | None) -> frozenset[str]:
    """The case keys the user gave explicitly (`model.<field>` as given). `overrides` None: a
    caller that cannot tell (every key of the composed config counts as given)."""
    if overrides is None:
        keys = set(CASE_KEYS)
    else:
        keys = {"layer" if k == "layer.name" else k for k in override_keys(overrides)}
    keys |= {k for k in ("local_t", "start_pos") if cfg.get(k) is not None}
    return frozenset(keys)


def _refuse(key: str, given, fact: Fact, what: str | None = None, value=None) -> ConfigError:
    how = f" ({fact.how})" if fact.how else ""
    shown = fact.value if value is None else value
    return ConfigError(f"{key}={given} contradicts the snapshot: {fact.source} holds {what or key}={shown}{how}")


def _model(config_model: ModelConfig, facts: SnapshotFacts, given: frozenset[str],
           field_overrides: dict[str, Any]) -> ModelConfig:
    """The snapshot's model with the user's explicit field overrides on top, or the model the
    user named (`model=...`), which must then agree with every field the snapshot fixes."""
    named = "model" in given
    if named or facts.model is None:
        model = config_model
    else:
        model = facts.model.replace(**field_overrides) if field_overrides else facts.model
    for name, fact in facts.model_fields.items():
        have = getattr(model, name)
        if have == fact.value:
            continue
        if name in field_overrides:
            raise _refuse(f"model.{name}", have, fact, name)
        raise ConfigError(f"model={model.name} contradicts the snapshot: {fact.source} holds {name}={fact.value}"
                          f"{f' ({fact.how})' if fact.how else ''}, model {model.name!r} has {name}={have}")
    return model


def _start_pos(layer: Layer, case: AnyCase, starts: tuple[tuple[int, ...], ...]) -> int | tuple[int, ...] | None:
    """The snapshot's starts as the config writes them: None when they are the layer's canonical
    set, an int when every request starts there, else one per request of the TP group."""
    flat = [s for rank in starts for s in rank]
    canonical = layer.start_positions(dataclasses.replace(case, start_pos=None))
    if canonical is not None and [list(r) for r in starts] == canonical:
        return None
    if len(set(flat)) == 1:
        return flat[0]
    return tuple(flat)


def replayed_layer(layer: str, facts: SnapshotFacts, given: frozenset[str]) -> str:
    """The layer a replay runs: the snapshot's, unless the user named another (refused)."""
    if facts.layer is None:
        return layer
    if "layer" in given and layer != facts.layer.value:
        raise _refuse("layer", layer, facts.layer)
    return facts.layer.value


def replayed_phase(phase: str, facts: SnapshotFacts, given: frozenset[str]) -> str:
    """The phase a replay runs: the snapshot's (a decode snapshot says none), unless the user
    named another (refused)."""
    return _agreed("phase", phase, facts, given) if facts.phase is not None else phase


def _agreed(key: str, current, facts: SnapshotFacts, given: frozenset[str]):
    """The snapshot's value of `key` where it has one (refusing a given value that differs),
    else the config's."""
    fact = facts.get(key)
    if fact is None:
        return current
    if key in given and current != fact.value:
        raise _refuse(key, current, fact)
    return fact.value


def _field_overrides(model: ModelConfig, given: frozenset[str]) -> dict[str, Any]:
    return {k.split(".", 1)[1]: getattr(model, k.split(".", 1)[1]) for k in given if k.startswith("model.")}


def _seed(case: AnyCase, facts: SnapshotFacts, given: frozenset[str]) -> int | None:
    """The snapshot's seed; None where it records none (a given seed is then no part of the run)."""
    return None if facts.seed is None else _agreed("seed", case.seed, facts, given)


def _read(facts: SnapshotFacts) -> tuple[str, ...]:
    read = [k for k in CASE_KEYS if k != "model" and facts.get(k) is not None]
    if facts.model is not None or facts.model_fields:
        read.append("model")
    return tuple(read)


def replayed_case(case: AnyCase, facts: SnapshotFacts, given: frozenset[str]) -> tuple[AnyCase, tuple[str, ...]]:
    """The case of a replay: every fact of the snapshot, checked against the keys the user gave.
    Returns the case and the keys read from the snapshot. The keys are the case's own
    (`snapshot_keys`); a token count the snapshot does not hold is the default for its model and
    group, and its starts are compared as the layer resolves them."""
    keys = type(case).snapshot_keys
    plain = [k for k in keys if k not in ("local_t", "start_pos")]
    values = {k: _agreed(k, getattr(case, k), facts, given) for k in plain}
    values["seed"] = _seed(case, facts, given)
    model = _model(case.model, facts, given, _field_overrides(case.model, given))
    replayed = dataclasses.replace(case, model=model, **values)
    if "local_t" in keys:
        replayed = dataclasses.replace(replayed, local_t=_local_t(case, replayed, facts, given))
    if "start_pos" in keys and facts.starts is not None:
        layer = get_scope(replayed.layer, replayed.scope)
        if "start_pos" in given:
            if layer.start_positions(replayed) != [list(r) for r in facts.starts.value]:
                given_starts = list(case.start_pos) if isinstance(case.start_pos, tuple) else case.start_pos
                raise _refuse("start_pos", given_starts, facts.starts, value=[list(r) for r in facts.starts.value])
        else:
            replayed = dataclasses.replace(replayed, start_pos=_start_pos(layer, replayed, facts.starts.value))
    return replayed, _read(facts)


def _local_t(case: AnyCase, replayed: AnyCase, facts: SnapshotFacts, given: frozenset[str]) -> int:
    """The snapshot's token count; the given one where it holds none; else the default for the
    replayed model, group and scope."""
    if facts.local_t is not None:
        if "local_t" in given and case.local_t != facts.local_t.value:
            raise _refuse("local_t", case.local_t, facts.local_t)
        return facts.local_t.value
    if "local_t" in given:
        return case.local_t
    whole = whole_requests(replayed.layer, replayed.scope)
    return type(case).default_local_t(replayed.model, replayed.group_size, whole)


def facts_entry(facts: SnapshotFacts, read: Sequence[str]) -> dict:
    """result.json's `snapshot`: the folder and each key read from it, with its file."""
    entry: dict[str, Any] = {"directory": facts.directory, "read": list(read)}
    for key in read:
        if key == "model":
            entry["model"] = {"name": facts.model.name if facts.model else None,
                              "fields": {n: {"value": f.value, "source": f.source} for n, f in facts.model_fields.items()}}
        else:
            f = facts.get(key)
            value = [list(r) for r in f.value] if key == "start_pos" else f.value
            entry[key] = {"value": value, "source": f.source}
    return entry


__all__ = ["Fact", "SnapshotFacts", "CASE_KEYS", "given_keys", "replayed_layer", "replayed_phase", "replayed_case", "facts_entry"]
