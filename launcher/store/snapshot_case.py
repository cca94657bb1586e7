"""What a snapshot says about its own case, read from its files (validation.md §4: a snapshot is
bound to one case), so that `golden_data=DIR` alone replays it.

* layer and scope from the tensor names: CSA holds the indexer pools, HCA `cmp_kv` without
  them, SWA neither; the focused scopes their own tensors (`proj_attention_local_groups`,
  `kv_group`), and a MoE snapshot its expert weights and `x_next` (recognised, not replayed:
  the launcher runs the attention layers only). `tp1` differs from `full` by its unsharded
  `wo_a`. Our manifest.json names both, which a scope snapshot needs for its layer.
* tp from the leading axis; local_t from `in/local_t.pt` (else x_out's token axis).
* start positions from `in/position_ids`: request b of rank r starts at
  `position_ids[r, b*decode_seq]`, its tokens must be consecutive, and `kv_seq_lens` (where the
  layer has it) must be start + decode_seq. Per-rank starts may differ between ranks.
* the model: our manifest's fields where it has them; else the dims the tensor shapes fix
  (`FIELDS`), and the first preset whose dims are those and whose every tensor shape fits the
  snapshot, or else the closest preset with those dims, named "snapshot".
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

from layers.contract.case import Case, MoECase
from layers.contract.config import PRESETS, ConfigError, ModelConfig
from layers.registry import get_scope

from launcher.config.replay import Fact, SnapshotFacts
from launcher.store import snapshot
from launcher.store.snapshot import Entry
from launcher.store.snapshot_layer import KINDS, SCOPE_KINDS, kind_of

# The file to cite for tp, by what the snapshot holds (first one present).
TP_ANCHORS = {"output": ("in/q", "out/o_local"), "collectives": ("in/kv_local", "out/o_local"),
              "moe": ("in/x_hc", "out/x_next")}
FULL_TP_ANCHORS = ("in/x_hc", "out/x_out", "in/wo_a")

Rule = tuple[str, tuple[str, ...], Callable[[tuple, int, dict], int]]


def _axis(i: int) -> Callable[[tuple, int, dict], int]:
    return lambda shape, tp, fields: shape[i]


def _groups(shape: tuple, tp: int, fields: dict) -> int:
    # wo_a's last axis is one group's input width heads_per_group * head_dim.
    return fields["num_attention_heads"] * fields["head_dim"] // shape[-1]


# (model field, the files that fix it (first present), its value from the file's shape) per
# layer or scope, in dependency order. Shapes are rank-stacked: axis 0 is tp.
_FRONT: tuple[Rule, ...] = (
    ("hidden_size", ("in/x_hc", "out/x_out"), _axis(-1)),
    ("hc_mult", ("in/x_hc", "out/x_out"), _axis(-2)),
    ("q_lora_rank", ("in/wq_a",), _axis(-1)),
    ("head_dim", ("in/wkv",), _axis(-1)),
    ("num_attention_heads", ("in/attn_sink",), _axis(-1)),
    ("o_lora_rank", ("in/wo_a",), _axis(-2)),
    ("o_groups", ("in/wo_a",), _groups),
    ("kv_ori_block_num", ("in/kv_cache", "out/kv_cache"), _axis(1)),
    ("block_size", ("in/kv_cache", "out/kv_cache"), _axis(2)),
    ("qk_rope_head_dim", ("in/freqs_cos",), _axis(-1)),
)
_COMPRESSED: tuple[Rule, ...] = (
    ("sliding_window", ("in/window_swa_indices",), _axis(-1)),
    ("kv_cmp_block_num", ("in/cmp_kv", "out/cmp_kv"), _axis(1)),
)
FIELDS: dict[str, tuple[Rule, ...]] = {
    "swa": _FRONT + (("sliding_window", ("in/swa_indices",), _axis(-1)),),
    "hca": _FRONT + _COMPRESSED + (
        ("hca_state_physical_blocks", ("in/compress_state", "out/compress_state"), _axis(1)),
        ("c128_state_block_size", ("in/compress_state", "out/compress_state"), _axis(2)),
        ("decode_batch", ("in/cmp_freqs_cos",), lambda shape, tp, fields: shape[1] * tp),
    ),
    "csa": _FRONT + _COMPRESSED + (
        ("max_position_embeddings", ("in/freqs_cos",), _axis(1)),
        ("csa_state_physical_blocks", ("in/compress_state", "out/compress_state"), _axis(1)),
        ("c4a_state_block_size", ("in/compress_state", "out/compress_state"), _axis(2)),
        ("csa_inner_state_physical_blocks", ("in/inner_compress_state", "out/inner_compress_state"), _axis(1)),
        ("idx_cache_block_num", ("in/idx_kv_cache", "out/idx_kv_cache"), _axis(1)),
        ("index_head_dim", ("in/idx_kv_cache", "out/idx_kv_cache"), _axis(-1)),
        ("index_n_heads", ("in/idx_wq_b",), lambda shape, tp, fields: shape[-1] // fields["index_head_dim"]),
    ),
    "output": (
        ("num_attention_heads", ("in/q",), _axis(-2)),
        ("head_dim", ("in/q",), _axis(-1)),
        ("hidden_size", ("in/wo_b", "out/o_local"), lambda shape, tp, fields: shape[1] if len(shape) == 3 else shape[-1]),
        ("o_lora_rank", ("in/wo_a",), _axis(-2)),
        ("o_groups", ("in/wo_a",), _groups),
        ("kv_ori_block_num", ("in/kv_cache",), _axis(1)),
        ("block_size", ("in/kv_cache",), _axis(2)),
        ("sliding_window", ("in/swa_indices",), _axis(-1)),
        ("qk_rope_head_dim", ("in/freqs_cos",), _axis(-1)),
    ),
    "collectives": (("hidden_size", ("in/kv_local", "out/o_local"), _axis(-1)),),
    "moe": (
        ("hidden_size", ("in/x_hc", "out/x_next"), _axis(-1)),
        ("hc_mult", ("in/x_hc", "out/x_next"), _axis(-2)),
        ("moe_intermediate_size", ("in/shared_w1", "in/routed_w1"), _axis(-2)),
        ("vocab_size", ("in/tid2eid",), _axis(1)),
        ("num_experts_per_tok", ("in/tid2eid",), _axis(-1)),
    ),
}


def describe(directory: str) -> SnapshotFacts:
    """Everything `directory` says about its case; ConfigError for a file that is not plain
    tensor data. An empty folder says nothing (its missing files are named by `snapshot.check`)."""
    if not os.path.isdir(directory):
        raise ConfigError(f"golden_data={directory}: no such directory")
    entries = snapshot.inventory(directory)
    names = {key.split("/", 1)[1] for key in entries}
    manifest = snapshot.read_manifest(directory) or {}
    manifest_path = os.path.join(directory, snapshot.MANIFEST)
    kind = kind_of(names)
    facts: dict = {}
    if "layer" in manifest:
        facts["layer"] = Fact(manifest["layer"], manifest_path)
    elif kind not in (None, *SCOPE_KINDS):
        facts["layer"] = _marked(entries, kind)
    tp_fact = _tp(entries, kind)
    if tp_fact is not None:
        facts["ep" if kind == "moe" else "tp"] = tp_fact
    tp = tp_fact.value if tp_fact else 1
    fields_kind = kind if kind in SCOPE_KINDS else facts["layer"].value if "layer" in facts else None
    derived = _derived_fields(entries, FIELDS.get(fields_kind, ()), tp)
    scope = _scope(manifest, manifest_path, kind, entries, derived, tp)
    if scope is not None:
        facts["scope"] = scope
    local_t = _local_t(entries)
    if local_t is not None:
        facts["local_t"] = local_t
    if manifest.get("seed") is not None:  # null: saved from a replay of a snapshot without one
        facts["seed"] = Fact(int(manifest["seed"]), manifest_path)
    layer_name = facts["layer"].value if "layer" in facts else "swa"
    if layer_name == "moe":
        facts.update(_moe_scalars(entries))
        case = MoECase(model=PRESETS["flash"], ep=tp, seed=0)
    else:
        case = Case(layer=layer_name, model=PRESETS["flash"], tp=tp, local_t=local_t.value if local_t else 0, seed=0,
                    scope=facts["scope"].value if "scope" in facts else "full")
    if "model_fields" in manifest:
        model = _manifest_model(manifest["model_fields"], manifest_path)
        model_fields = {n: Fact(v, manifest_path) for n, v in model.fields().items() if n != "name"}
    else:  # no dims at all (an empty folder): the model is the config's
        model = _select_model(case, derived, entries) if derived else None
        model_fields = dict(derived)
    positions = entries.get("in/position_ids")
    # Tokens that disagree with local_t: the shape check names the files (starts would not fit).
    if positions is not None and (local_t is None or positions.shape[1:] == (local_t.value,)):
        starts = _starts(positions, entries.get("in/kv_seq_lens"), (model or PRESETS["flash"]).decode_seq)
        facts["starts"] = Fact(starts, positions.path)
    return SnapshotFacts(directory=directory, model=model, model_fields=model_fields, **facts)


def _moe_scalars(entries: dict[str, Entry]) -> dict[str, Fact]:
    """The MoE case's layer_id and num_tokens, each from its 0-dim int32 file."""
    facts = {}
    for key in ("layer_id", "num_tokens"):
        entry = entries.get(f"in/{key}")
        if entry is not None:
            facts[key] = Fact(int(snapshot.load_scalar(entry.path, torch.int32)), entry.path)
    return facts


def _marked(entries: dict[str, Entry], kind: str) -> Fact:
    """`kind` as a fact, cited from the first file whose name tells it."""
    marks = dict(KINDS)[kind]
    key = next(f"{sub}/{n}" for sub in snapshot.SUBDIRS for n in marks if f"{sub}/{n}" in entries)
    return Fact(kind, entries[key].path, "the tensors it holds")


def _tp(entries: dict[str, Entry], kind: str | None) -> Fact | None:
    """The leading axis most files share (one damaged file is then named by the shape check),
    cited from the layer's anchor file where that one has it."""
    leading = [e.shape[0] for e in entries.values() if e.shape]
    if not leading:
        return None
    tp = max(set(leading), key=leading.count)
    keys = [k for k in TP_ANCHORS.get(kind, FULL_TP_ANCHORS) if k in entries] + list(entries)
    key = next(k for k in keys if entries[k].shape and entries[k].shape[0] == tp)
    return Fact(tp, entries[key].path, "its leading axis")


def _derived_fields(entries: dict[str, Entry], rules: tuple[Rule, ...], tp: int) -> dict[str, Fact]:
    values: dict[str, int] = {}
    facts: dict[str, Fact] = {}
    for name, keys, value in rules:
        key = next((k for k in keys if k in entries), None)
        if key is None or name in values:
            continue
        try:
            values[name] = int(value(entries[key].shape, tp, values))
        except (IndexError, KeyError, ZeroDivisionError):  # a shape the final check will name
            continue
        facts[name] = Fact(values[name], entries[key].path, f"shape {entries[key].shape}")
    return facts


def _scope(manifest: dict, manifest_path: str, kind: str | None, entries: dict[str, Entry],
           derived: dict[str, Fact], tp: int) -> Fact | None:
    if "scope" in manifest:
        return Fact(manifest["scope"], manifest_path)
    if kind in SCOPE_KINDS:
        return _marked(entries, kind)
    wo_a, groups = entries.get("in/wo_a"), derived.get("o_groups")
    if kind is None or wo_a is None or groups is None or tp == 1:
        return None
    # tp1 runs every rank with the full O weights: wo_a holds every group, not G/tp of them.
    return Fact("tp1" if wo_a.shape[1] == groups.value else "full", wo_a.path, f"shape {wo_a.shape}")


def _local_t(entries: dict[str, Entry]) -> Fact | None:
    if "in/local_t" in entries:
        path = entries["in/local_t"].path
        return Fact(int(snapshot.load_scalar(path, torch.int32)), path)
    x_out = entries.get("out/x_out")
    if x_out is not None and len(x_out.shape) == 4:
        return Fact(x_out.shape[1], x_out.path, "its token axis")
    return None


def _manifest_model(fields: dict, source: str) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise ConfigError(f"{source}: its model_fields do not describe a model of this tool ({e})") from e


def _select_model(case: Case | MoECase, derived: dict[str, Fact], entries: dict[str, Entry]) -> ModelConfig:
    """The first preset with the snapshot's dims whose every tensor fits it, else the closest
    preset given those dims (named "snapshot")."""
    dims = {n: f.value for n, f in derived.items()}
    presets = [p for p in PRESETS.values() if all(getattr(p, n) == v for n, v in dims.items())]
    if not presets:
        base = max(PRESETS.values(), key=lambda p: sum(getattr(p, n) == v for n, v in dims.items()))
        try:
            presets = [base.replace(name="snapshot", **dims)]
        except ConfigError as e:
            raise ConfigError(f"{case.layer} snapshot: its tensor shapes give no valid model ({e})") from e
    return next((m for m in presets if _fits(dataclasses.replace(case, model=m), entries)), presets[0])


def _fits(case: Case | MoECase, entries: dict[str, Entry]) -> bool:
    """Whether every file present has the shape and dtype `case` gives it."""
    positions = entries.get("in/position_ids")
    try:
        if positions is not None:
            starts = _starts(positions, None, case.model.decode_seq)
            case = dataclasses.replace(case, start_pos=tuple(s for rank in starts for s in rank))
        if isinstance(case, Case) and not case.local_t:
            case = dataclasses.replace(case, local_t=case.capacity)
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
