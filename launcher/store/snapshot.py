"""Snapshots in the reference golden-harness layout: `in/<name>.pt`, `out/<name>.pt`, rank-stacked.

`in/` holds every pure input, every in-out tensor's value before the step and every scalar as a
0-dim tensor (`local_t`); `out/` holds every output after the step (x_out and every mutated
cache/state). Tensors carry a leading rank axis of size tp, except 0-dim scalars; the sharded O
weights are stacked shards (`wo_a[tp, G/tp, OL, GI]`, `wo_b[tp, D, (G/tp)*OL]`). We add a
`manifest.json` the reference ignores; its sha256 per file is verified on replay, and the
manifest itself carries `manifest_sha256`, the digest of the rest of its content: a manifest
whose case (seed, model_fields, ...) was edited after the save is refused, as is one without
that digest (delete manifest.json to replay such a snapshot as the reference's, from its files).

Reading follows the reference runner's replay rules (validation.md §4, §13.8): every missing
file is named at once, a scalar file must hold a 0-dim tensor of the spec's dtype. Files are
read with `weights_only=True` (a snapshot is data and must never run code) and memory-mapped,
so a rank reads only its own slice; a file that is not a torch.save archive, holds anything but
one dense tensor, or no longer matches its recorded sha256 is refused as a snapshot error.

Writing never mixes two snapshots: `save` builds the new one in a sibling folder and swaps it
in whole; `check_save_target` refuses, before launch, a target that is a file or a folder with
anything in it, unless it is a snapshot and overwriting was asked for.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import shutil
import uuid
import zipfile
from dataclasses import dataclass
from importlib import metadata

import torch

from layers.contract.case import Case
from layers.contract.config import ConfigError
from layers.contract.tensors import Kind, TensorSpec

from launcher.store.snapshot_layer import MANIFEST, SUBDIRS

MANIFEST_HASH = "manifest_sha256"  # the manifest's own digest, over every other key
# What a folder may hold to be replaced by `save_overwrite=true`: a snapshot's parts (ours, and
# the reference.json the reference's shared snapshots carry).
SNAPSHOT_PARTS = {"in", "out", MANIFEST, "reference.json"}


@functools.cache  # a scan of every installed distribution: 30 ms a call
def tool_version() -> str:
    try:
        return metadata.version("dsv4-tp-harness")
    except metadata.PackageNotFoundError:
        return "0+checkout"


def _is_scalar(spec: TensorSpec) -> bool:
    return spec.shape == ()


def _files(specs: dict[str, TensorSpec]) -> list[tuple[str, str, TensorSpec]]:
    """(subdir, name, spec) of every file a snapshot of these specs must hold."""
    files = []
    for name, spec in specs.items():
        if spec.kind in (Kind.INPUT, Kind.INOUT):
            files.append(("in", name, spec))
        if spec.kind in (Kind.INOUT, Kind.OUTPUT):
            files.append(("out", name, spec))
    return files


def path_of(directory: str, sub: str, name: str) -> str:
    return os.path.join(directory, sub, f"{name}.pt")


# -- reading ------------------------------------------------------------------------------------


def _not_a_torch_file(path: str) -> str | None:
    """Why `path` is not a torch.save archive (torch.save writes a zip), None when it is one."""
    if zipfile.is_zipfile(path):
        return None
    link = f", a symlink to {os.path.realpath(path)}" if os.path.islink(path) else ""
    with open(path, "rb") as f:
        head = f.read(16)
    return f"{path}: not a torch.save file{link} (a torch.save file is a zip archive; this one starts with {head!r})"


def load(path: str) -> torch.Tensor:
    """The one dense tensor a snapshot file holds, memory-mapped; ConfigError for anything else."""
    try:
        problem = _not_a_torch_file(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from e
    if problem:
        raise ConfigError(problem)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: refused to load, it is not plain tensor data ({first})") from e
    except Exception as e:  # a truncated archive or a zip that is not torch's
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise ConfigError(f"{path}: cannot be read as a torch.save file ({reason})") from e
    if not isinstance(obj, torch.Tensor):
        raise ConfigError(f"{path}: holds a {type(obj).__name__}, expected one tensor")
    if obj.layout != torch.strided:  # a sparse tensor would reach the implementation as it is
        raise ConfigError(f"{path}: holds a {obj.layout} tensor; a snapshot file holds one dense tensor")
    return obj


def load_scalar(path: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A scalar file: a 0-dim tensor (of `dtype` when given), the reference runner's rule."""
    t = load(path)
    if t.dim() != 0:
        raise ConfigError(f"{path} must contain a 0-dim torch.Tensor, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ConfigError(f"{path} dtype mismatch: spec={dtype} cache={t.dtype}")
    return t


def read_manifest(directory: str) -> dict | None:
    """Our manifest.json, None where the snapshot has none (the reference writes none)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise ConfigError(f"{path}: holds a {type(manifest).__name__}, expected a JSON object")
    if MANIFEST_HASH not in manifest:
        raise ConfigError(f"{path}: records no {MANIFEST_HASH}, so its case cannot be trusted (saved by an earlier "
                          f"version, or edited): save the snapshot again, or delete {MANIFEST} to replay it as a "
                          f"reference snapshot, its case read from its files")
    if manifest[MANIFEST_HASH] != manifest_digest(manifest):
        raise ConfigError(f"{path}: its content is not the one its {MANIFEST_HASH} records (the manifest was "
                          f"edited after the snapshot was saved)")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """The sha256 of a manifest's keys but its own digest, as canonical JSON (sorted keys), so
    that the file's layout does not count, every value does."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_HASH}))  # as it reads back
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(manifest: dict) -> dict:
    """`manifest` with its `manifest_sha256`."""
    return {**manifest, MANIFEST_HASH: manifest_digest(manifest)}


def missing_files(directory: str, specs: dict[str, TensorSpec]) -> list[str]:
    return [p for sub, n, _ in _files(specs) if not os.path.isfile(p := path_of(directory, sub, n))]


def check(directory: str, specs: dict[str, TensorSpec], tp: int) -> None:
    """Refuse a snapshot that does not fit the case: every missing file at once, then the first
    file whose shape, dtype, rank axis or recorded sha256 is wrong (one line each)."""
    if not os.path.isdir(directory):
        raise ConfigError(f"golden_data={directory}: no such directory")
    missing = missing_files(directory, specs)
    if missing:
        raise ConfigError(f"golden_data is missing files: {missing}")
    for sub, name, spec in _files(specs):
        path = path_of(directory, sub, name)
        if _is_scalar(spec):
            load_scalar(path, spec.dtype)
            continue
        t = load(path)
        want = (tp, *spec.shape)
        if tuple(t.shape) != want or t.dtype != spec.dtype:
            raise ConfigError(
                f"{path}: shape {tuple(t.shape)} dtype {t.dtype}, expected shape {want} dtype {spec.dtype} "
                f"(leading axis = tp = {tp})"
            )
    verify_hashes(directory)


def verify_hashes(directory: str) -> None:
    """Every file the manifest lists a sha256 for must still have it: a changed byte of a
    replayed golden must never pass silently."""
    manifest = read_manifest(directory)
    recorded = (manifest or {}).get("sha256") or {}
    for rel, digest in sorted(recorded.items()):
        path = os.path.join(directory, rel)
        if os.path.isfile(path) and sha256(path) != digest:
            raise ConfigError(
                f"{path}: its sha256 is not the one {os.path.join(directory, MANIFEST)} records "
                f"(the file changed after the snapshot was saved)"
            )


@dataclass(frozen=True)
class Entry:
    """One file of a snapshot as read once: its tensor's shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def inventory(directory: str) -> dict[str, Entry]:
    """Every `.pt` file of `in/` and `out/` by `sub/name`, each loaded once (header only)."""
    entries = {}
    for sub in SUBDIRS:
        folder = os.path.join(directory, sub)
        if not os.path.isdir(folder):
            continue
        for file in sorted(os.listdir(folder)):
            if file.endswith(".pt"):
                t = load(os.path.join(folder, file))
                entries[f"{sub}/{file[:-3]}"] = Entry(os.path.join(folder, file), tuple(t.shape), t.dtype)
    return entries


def load_rank(directory: str, sub: str, names, rank: int, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of each named tensor of `in/` or `out/` (only that slice is read)."""
    out = {}
    for name in names:
        t = load(path_of(directory, sub, name))
        out[name] = t.clone() if _is_scalar(specs[name]) else t[rank].clone()
    return out


def full_o_weights(directory: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded O weights reassembled from the stacked shards (validation.md §5.3)."""
    wo_a = load(path_of(directory, "in", "wo_a"))  # [P, G/P, OL, GI]
    wo_b = load(path_of(directory, "in", "wo_b"))  # [P, D, (G/P)*OL]
    p, d, lw = wo_b.shape
    return (
        wo_a.reshape(-1, *wo_a.shape[2:]).clone(),
        wo_b.permute(1, 0, 2).reshape(d, p * lw).contiguous(),
    )


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- writing ------------------------------------------------------------------------------------


def check_save_target(directory: str, overwrite: bool, golden_data: str | None = None,
                      specs: dict[str, TensorSpec] | None = None) -> None:
    """Before launch: `save_data` must be a new or empty folder, or (with `save_overwrite=true`)
    a snapshot to replace; never a file, another folder's contents or the replayed snapshot;
    and every name the snapshot of `specs` will write must fit the file system's limits."""
    key = f"save_data={directory}"
    if golden_data and os.path.commonpath([directory, golden_data]) == golden_data:
        raise ConfigError(f"{key} is (inside) the replayed snapshot golden_data={golden_data}")
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"{key} is a file; a snapshot is a folder")
    if os.path.isdir(directory) and (entries := sorted(os.listdir(directory))):
        if not overwrite:
            raise ConfigError(f"{key} is not empty (it holds {_listing(entries)}): choose a new folder, "
                              f"or set save_overwrite=true to replace the snapshot in it")
        foreign = [e for e in entries if e not in SNAPSHOT_PARTS]
        if foreign:
            raise ConfigError(f"{key} holds {_listing(foreign)}, which no snapshot holds: save_overwrite=true "
                              f"replaces a snapshot only, it never deletes other files")
    parent = _existing_ancestor(directory)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {parent} is not writable")
    if specs is not None:
        _check_name_lengths(key, directory, specs, parent)


# The sibling folders `save` builds a snapshot in and moves an earlier one aside to (TOKEN: 8 hex digits).
def _building(parent: str, base: str, token: str) -> str:
    return os.path.join(parent, f".{base}.partial-{token}")


def _set_aside(parent: str, base: str, token: str) -> str:
    return os.path.join(parent, f".{base}.old-{token}")


def _check_name_lengths(key: str, directory: str, specs: dict[str, TensorSpec], existing: str) -> None:
    """Every name `save` will create fits the file system's limits (NAME_MAX per name, PATH_MAX
    per path), so that a long `save_data` is refused before launch, not by an ENAMETOOLONG
    after the fixture and the golden ran."""
    name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    parent, base = os.path.split(os.path.abspath(directory))
    token = "0" * 8
    paths = [directory, _set_aside(parent, base, token)] + [
        path_of(_building(parent, base, token), sub, name) for sub, name, _ in _files(specs)]
    paths.append(os.path.join(_building(parent, base, token), MANIFEST))
    for path in paths:
        path = os.path.abspath(path)
        long_name = max(path.split(os.sep), key=len)
        if len(os.fsencode(long_name)) > name_max:
            raise ConfigError(f"{key}: the snapshot would write the name {long_name[:40]}... of "
                              f"{len(os.fsencode(long_name))} bytes, over this file system's limit of {name_max}; "
                              f"choose a shorter folder name")
        if len(os.fsencode(path)) >= path_max:
            raise ConfigError(f"{key}: the snapshot would write a path of {len(os.fsencode(path))} bytes "
                              f"({path[:40]}...), over this file system's limit of {path_max - 1}; choose a shorter path")


def _listing(entries: list[str], shown: int = 5) -> str:
    more = f", ... {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more


def _existing_ancestor(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path if os.path.isdir(path) else os.path.dirname(path)


def save(directory: str, case: Case, specs: dict[str, TensorSpec], inputs: dict, outputs: dict, starts: list) -> None:
    """Write a snapshot of rank-stacked `inputs` (in/) and `outputs` (out/), plus the manifest.

    Built in a sibling folder and moved into place whole, replacing what `directory` held (the
    preflight allowed only an empty folder or, with save_overwrite, an earlier snapshot): a
    reader never sees a half-written snapshot, nor files left from an earlier one.
    """
    parent, base = os.path.split(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    building = _building(parent, base, token)
    for sub in SUBDIRS:
        os.makedirs(os.path.join(building, sub))
    try:
        hashes = {}
        for sub, name, spec in _files(specs):
            t = (inputs if sub == "in" else outputs)[name]
            # Scalars are shared by the ranks and stored once, as a 0-dim tensor.
            torch.save((t[0] if _is_scalar(spec) else t).contiguous(), path_of(building, sub, name))
            hashes[f"{sub}/{name}.pt"] = sha256(path_of(building, sub, name))
        with open(os.path.join(building, MANIFEST), "w") as f:
            json.dump(sealed(_manifest(case, starts, hashes)), f, indent=1)
        _swap_in(building, directory, _set_aside(parent, base, token))
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _swap_in(building: str, directory: str, old: str) -> None:
    if os.path.isdir(directory):
        os.rename(directory, old)
    os.rename(building, directory)
    shutil.rmtree(old, ignore_errors=True)


def _manifest(case: Case, starts: list | None, hashes: dict) -> dict:
    return {
        **case.describe(),
        "model": case.model.name,
        "model_fields": case.model.fields(),
        "start_positions_by_rank": starts,
        "tool_version": tool_version(),
        "torch": torch.__version__,
        "sha256": hashes,
    }
