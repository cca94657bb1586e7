"""What a snapshot says about its own case, read from its files (validation.md §4: a snapshot is
bound to one case), so that `golden_data=DIR` alone replays it.

* layer and scope from the tensor names, through each layer's and scope's declaration
  (`layers.declared`: the names that tell it, which kinds it is recognised before); a MoE
  snapshot is recognised the same way. `tp1` differs from `full` by its unsharded `wo_a`. Our
  manifest.json names both, which a scope snapshot needs for its layer.
* the group size (tp, or the declared key: ep) from the leading axis; the declared case
  scalars (local_t; MoE's layer_id, num_tokens) from their 0-dim files, local_t else from
  x_out's token axis.
* start positions from `in/position_ids`: request b of rank r starts at
  `position_ids[r, b*decode_seq]`, its tokens must be consecutive, and `kv_seq_lens` (where the
  layer has it) must be start + decode_seq. Per-rank starts may differ between ranks.
* the model: our manifest's fields where it has them; else the dims the tensor shapes fix (the
  layer's declared `dims`), and the first preset whose dims are those and whose every tensor
  shape fits the snapshot, or else the closest preset with those dims, named "snapshot".
* the seed from our manifest only (the reference records none of ours: the MoE one's
  `seed` seeds its own generator, not this project's fixtures).

Every fact names the file it was read from. The files' shapes against the whole case, the
missing files and the manifest's sha256 are checked afterwards (`snapshot.check`), once the
command line's keys are merged in (`launcher.config.replay`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from layers.contract.config import PRESETS, ConfigError, ModelConfig
from layers.contract.declaration import Declaration, Dim
from layers.declared import declaration, phase_declarations
from layers.registry import PHASES, AnyCase, case_type, get_scope, layer_names

from launcher.config.replay import Fact, SnapshotFacts
from launcher.config.schema import layer_groups
from launcher.store import snapshot
from launcher.store.snapshot import Entry
from launcher.store.snapshot_layer import kind_of


def describe(directory: str) -> SnapshotFacts:
    """Everything `directory` says about its case; ConfigError for a file that is not plain
    tensor data. An empty folder says nothing (its missing files are named by `snapshot.check`)."""
    if not os.path.isdir(directory):
        raise ConfigError(f"golden_data={directory}: no such directory")
    entries = snapshot.inventory(directory)
    names = {key.split("/", 1)[1] for key in entries}
    manifest = snapshot.read_manifest(directory) or {}
    manifest_path = os.path.join(directory, snapshot.MANIFEST)
    phase_kind = next((d for d in phase_declarations() if all(f"in/{n}" in entries for n in d.marks)), None)
    if phase_kind is not None:
        return _describe_prefill(directory, entries, manifest, manifest_path, phase_kind)
    kind = kind_of(names)
    facts: dict = {}
    if "layer" in manifest:
        facts["layer"] = Fact(manifest["layer"], manifest_path)
    elif kind is not None and not kind.scope:
        facts["layer"] = _marked(entries, kind)
    # A scope's snapshot without our manifest names no layer: the first layer's is assumed.
    layer_name = facts["layer"].value if "layer" in facts else layer_names()[0]
    layer = declaration(layer_name)
    group_key = (layer or kind).group_key if (layer or kind) else "tp"
    tp_fact = _tp(entries, kind)
    if tp_fact is not None:
        facts[group_key] = tp_fact
    tp = tp_fact.value if tp_fact else 1
    shapes_of = kind if kind is not None and kind.scope else layer if "layer" in facts else None
    derived = _derived_fields(entries, shapes_of.dims if shapes_of else (), tp)
    scope = _scope(manifest, manifest_path, kind, entries, derived, tp)
    if scope is not None:
        facts["scope"] = scope
    if layer is not None:
        facts.update(_scalars(entries, layer, tp))
    if manifest.get("seed") is not None:  # null: saved from a replay of a snapshot without one
        facts["seed"] = Fact(int(manifest["seed"]), manifest_path)
    local_t = facts.get("local_t")
    scope_name = facts["scope"].value if "scope" in facts else "full"

    def case_for(model: ModelConfig) -> AnyCase:
        """The snapshot's case under `model` (ConfigError: a layer without snapshots of its case)."""
        group = layer_groups().get(layer_name)
        kind = case_type(layer_name, PHASES[0], group["key_set"]) if group else None
        if not hasattr(kind, "of_snapshot"):
            raise ConfigError(f"layer={layer_name} has no snapshot layout")
        return kind.of_snapshot(layer_name, model, tp, scope_name, local_t.value if local_t else None)

    if "model_fields" in manifest:
        model = _manifest_model(manifest["model_fields"], manifest_path)
        model_fields = {n: Fact(v, manifest_path) for n, v in model.fields().items() if n != "name"}
    else:  # no dims at all (an empty folder): the model is the config's
        model = _select_model(layer_name, case_for, derived, entries) if derived else None
        model_fields = dict(derived)
    positions = entries.get("in/position_ids")
    # Tokens that disagree with local_t: the shape check names the files (starts would not fit).
    if positions is not None and (local_t is None or positions.shape[1:] == (local_t.value,)):
        starts = _starts(positions, entries.get("in/kv_seq_lens"), (model or PRESETS["flash"]).decode_seq)
        facts["starts"] = Fact(starts, positions.path)
    return SnapshotFacts(directory=directory, model=model, model_fields=model_fields, **facts)


def _describe_prefill(directory: str, entries: dict[str, Entry], manifest: dict, manifest_path: str,
                      kind: Declaration) -> SnapshotFacts:
    """A CP prefill snapshot's case (`kind`, its phase's declaration): phase and cp from its
    files (cp: the leading axis), the segments from segment_starts_t and overlay_active_lengths;
    layout, scope, seed and model from our manifest where it has them, else zigzag (the
    reference's), the whole step, no seed, and the preset whose dims the shapes fix. An
    exchange's snapshot (scope=collectives) holds no segment tables: its manifest gives them."""
    mark = entries[f"in/{kind.marks[0]}"]
    anchor = entries[kind.anchors[0]]
    facts: dict = {"layer": Fact(manifest.get("layer", kind.name), manifest_path if "layer" in manifest else anchor.path,
                                 "" if "layer" in manifest else "the tensors it holds"),
                   "phase": Fact(kind.phase, mark.path, "the tensors it holds"),
                   kind.group_key: Fact(anchor.shape[0], anchor.path, "its leading axis")}
    if "cp_layout" in manifest:
        facts["cp_layout"] = Fact(manifest["cp_layout"], manifest_path)
    if "scope" in manifest:
        facts["scope"] = Fact(manifest["scope"], manifest_path)
    starts_entry, active_entry = entries.get("in/segment_starts_t"), entries.get("in/overlay_active_lengths")
    if starts_entry is None or active_entry is None:  # an exchange alone: no layout tables, the case is our manifest's
        missing = [k for k in ("scope", "prefix", "segment_lens") if k not in manifest]
        if missing:
            raise ConfigError(f"golden_data={directory}: a prefill exchange's snapshot ({kind.name}) holds no "
                              f"segment tables; its {manifest_path} must name {', '.join(missing)}")
        facts["prefix"] = Fact(int(manifest["prefix"]), manifest_path)
        facts["segment_lens"] = Fact(tuple(int(n) for n in manifest["segment_lens"]), manifest_path)
    else:
        starts = snapshot.load(starts_entry.path).tolist()
        facts["prefix"] = Fact(int(starts[0]), starts_entry.path, "its first start")
        active = snapshot.load(active_entry.path)[..., 1].sum(dim=-1)  # [cp, 2]: each part's segment length
        lens = _prefill_lengths(snapshot.load(entries["in/reverse_index"].path).tolist(), active)
        facts["segment_lens"] = Fact(tuple(lens), active_entry.path, "its active rows per segment")
    if manifest.get("seed") is not None:
        facts["seed"] = Fact(int(manifest["seed"]), manifest_path)
    if "model_fields" in manifest:
        model = _manifest_model(manifest["model_fields"], manifest_path)
        fields = {n: Fact(v, manifest_path) for n, v in model.fields().items() if n != "name"}
    else:
        fields = _derived_fields(entries, kind.dims, anchor.shape[0])
        dims = {n: f.value for n, f in fields.items()}
        model = next((p for p in PRESETS.values() if all(getattr(p, n) == v for n, v in dims.items())), None)
        if model is None:
            base = max(PRESETS.values(), key=lambda p: sum(getattr(p, n) == v for n, v in dims.items()))
            model = base.replace(name="snapshot", **dims)
    return SnapshotFacts(directory=directory, model=model, model_fields=fields, **facts)


def _prefill_lengths(reverse_index: list[int], active: torch.Tensor) -> list[int]:
    """Each logical segment's length: segment s sits at rank-major block reverse_index[s]
    (rank = block // 2, part = block % 2)."""
    return [int(active[b // 2, b % 2]) for b in reverse_index]


def _scalars(entries: dict[str, Entry], layer: Declaration, group: int) -> dict[str, Fact]:
    """The case keys `layer` stores as 0-dim int32 files `in/<key>.pt`, else where its tensor
    shapes fix them (`Declaration.case_dims`)."""
    facts = {}
    for key in layer.scalars:
        entry = entries.get(f"in/{key}")
        if entry is not None:
            facts[key] = Fact(int(snapshot.load_scalar(entry.path, torch.int32)), entry.path)
    shaped = _derived_fields(entries, tuple(d for d in layer.case_dims if d.field not in facts), group)
    return facts | {key: Fact(f.value, f.source, "its token axis") for key, f in shaped.items()}


def _marked(entries: dict[str, Entry], kind: Declaration) -> Fact:
    """`kind` as a fact, cited from the first file whose name tells it."""
    key = next(f"{sub}/{n}" for sub in snapshot.SUBDIRS for n in kind.marks if f"{sub}/{n}" in entries)
    return Fact(kind.name, entries[key].path, "the tensors it holds")


def _tp(entries: dict[str, Entry], kind: Declaration | None) -> Fact | None:
    """The leading axis most files share (one damaged file is then named by the shape check),
    cited from the layer's anchor file where that one has it."""
    leading = [e.shape[0] for e in entries.values() if e.shape]
    if not leading:
        return None
    tp = max(set(leading), key=leading.count)
    keys = [k for k in (kind.anchors if kind else ()) if k in entries] + list(entries)
    key = next(k for k in keys if entries[k].shape and entries[k].shape[0] == tp)
    return Fact(tp, entries[key].path, "its leading axis")


def _derived_fields(entries: dict[str, Entry], dims: tuple[Dim, ...], tp: int) -> dict[str, Fact]:
    """The values `dims` read from the files present (the first file of each that is there)."""
    values: dict[str, int] = {}
    facts: dict[str, Fact] = {}
    for dim in dims:
        name = dim.field
        key = next((k for k in dim.files if k in entries), None)
        if key is None or name in values:
            continue
        try:
            values[name] = int(dim.value(entries[key].shape, tp, values))
        except (IndexError, KeyError, ZeroDivisionError):  # a shape the final check will name
            continue
        facts[name] = Fact(values[name], entries[key].path, f"shape {entries[key].shape}")
    return facts


def _scope(manifest: dict, manifest_path: str, kind: Declaration | None, entries: dict[str, Entry],
           derived: dict[str, Fact], tp: int) -> Fact | None:
    if "scope" in manifest:
        return Fact(manifest["scope"], manifest_path)
    if kind is not None and kind.scope:
        return _marked(entries, kind)
    wo_a, groups = entries.get("in/wo_a"), derived.get("o_groups")
    if kind is None or wo_a is None or groups is None or tp == 1:
        return None
    # tp1 runs every rank with the full O weights: wo_a holds every group, not G/tp of them.
    return Fact("tp1" if wo_a.shape[1] == groups.value else "full", wo_a.path, f"shape {wo_a.shape}")


def _manifest_model(fields: dict, source: str) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise ConfigError(f"{source}: its model_fields do not describe a model of this tool ({e})") from e


def _select_model(layer: str, case_for: Callable[[ModelConfig], AnyCase], derived: dict[str, Fact],
                  entries: dict[str, Entry]) -> ModelConfig:
    """The first preset with the snapshot's dims whose every tensor fits it (`case_for(model)`:
    the snapshot's case under that model), else the closest preset given those dims (named
    "snapshot")."""
    dims = {n: f.value for n, f in derived.items()}
    presets = [p for p in PRESETS.values() if all(getattr(p, n) == v for n, v in dims.items())]
    if not presets:
        base = max(PRESETS.values(), key=lambda p: sum(getattr(p, n) == v for n, v in dims.items()))
        try:
            presets = [base.replace(name="snapshot", **dims)]
        except ConfigError as e:
            raise ConfigError(f"{layer} snapshot: its tensor shapes give no valid model ({e})") from e
    return next((m for m in presets if _fits(case_for, m, entries)), presets[0])


def _fits(case_for: Callable[[ModelConfig], AnyCase], model: ModelConfig, entries: dict[str, Entry]) -> bool:
    """Whether every file present has the shape and dtype the snapshot's case under `model` gives it."""
    positions = entries.get("in/position_ids")
    try:
        case = case_for(model)
        if positions is not None:
            starts = _starts(positions, None, case.model.decode_seq)
            case = dataclasses.replace(case, start_pos=tuple(s for rank in starts for s in rank))
        specs = get_scope(case.layer, case.scope).tensor_specs(case)
    except (ConfigError, ValueError, IndexError, ZeroDivisionError):
        return False
    for key, entry in entries.items():
        sub, name = key.split("/", 1)
        spec = specs.get(name)
        if spec is None:
            continue
        want = spec.shape if spec.shape == () else (case.group_size, *spec.shape)
        if entry.shape != want or entry.dtype != spec.dtype:
            return False
    return True


def _starts(positions: Entry, seq_lens: Entry | None, seq: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's request starts from `position_ids [P, t]`, checked for consecutive tokens per
    request and, when given, against `kv_seq_lens [P, batch]` (start + decode_seq)."""
    pos = snapshot.load(positions.path).to(torch.int64)
    if pos.dim() != 2 or pos.shape[1] % seq:
        raise ConfigError(f"{positions.path}: shape {tuple(pos.shape)}, expected [tp, local_t] with local_t a "
                          f"multiple of decode_seq={seq}")
    p, t = pos.shape
    per_request = pos.reshape(p, t // seq, seq)
    starts = per_request[:, :, 0]
    steps = starts[:, :, None] + torch.arange(seq)
    if not torch.equal(per_request, steps):
        r, b = (int(i) for i in torch.nonzero((per_request != steps).any(dim=2))[0])
        raise ConfigError(f"{positions.path}: rank {r} request {b} has positions {per_request[r, b].tolist()}, "
                          f"not {seq} consecutive ones (one request of decode_seq={seq} tokens)")
    if seq_lens is not None:
        lens = snapshot.load(seq_lens.path).to(torch.int64)
        if tuple(lens.shape) == tuple(starts.shape) and not torch.equal(lens, starts + seq):
            r, b = (int(i) for i in torch.nonzero(lens != starts + seq)[0])
            raise ConfigError(f"{seq_lens.path}: rank {r} request {b} has kv_seq_len {int(lens[r, b])}, but "
                              f"{positions.path} starts it at {int(starts[r, b])} (expected {int(starts[r, b]) + seq})")
    return tuple(tuple(int(s) for s in rank) for rank in starts)
