"""Snapshots in the reference golden-harness layout: `in/<name>.pt`, `out/<name>.pt`, rank-stacked.

`in/` holds every pure input, every in-out tensor's value before the step and every scalar as a
0-dim tensor (`local_t`); `out/` holds every output after the step (x_out and every mutated
cache/state). Tensors carry a leading rank axis of size tp, except 0-dim scalars; the sharded O
weights are stacked shards (`wo_a[tp, G/tp, OL, GI]`, `wo_b[tp, D, (G/tp)*OL]`). We add a
`manifest.json` the reference ignores. Files are read with `weights_only=True` (a snapshot is
data and must never run code) and memory-mapped, so a rank reads only its own slice.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from importlib import metadata

import torch

from layers.contract.tensors import Kind, TensorSpec
from layers.contract.case import Case
from layers.contract.config import ConfigError

MANIFEST = "manifest.json"


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


def _load(path: str) -> torch.Tensor:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: refused to load, it is not plain tensor data ({first})") from e
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f"{path}: cannot be read as a torch.save file ({type(e).__name__}: {e})") from e
    if not isinstance(obj, torch.Tensor):
        raise ConfigError(f"{path}: holds a {type(obj).__name__}, expected one tensor")
    return obj


def load_scalar(path: str) -> torch.Tensor:
    t = _load(path)
    if t.dim() != 0:
        raise ConfigError(f"{path}: must contain a 0-dim torch.Tensor, got shape {tuple(t.shape)}")
    return t


def fixed_local_t(directory: str, requested: int | None) -> int | None:
    """The local_t a snapshot fixes (its in/local_t.pt), None where it holds none; a different
    `requested` local_t (one the config states explicitly) is refused."""
    path = os.path.join(directory, "in", "local_t.pt")
    if not os.path.isfile(path):
        return None
    local_t = int(load_scalar(path))
    if requested is not None and int(requested) != local_t:
        raise ConfigError(f"local_t={requested} but the snapshot {path} holds local_t={local_t}")
    return local_t


def check(directory: str, specs: dict[str, TensorSpec], tp: int) -> None:
    """Refuse a snapshot that does not fit the case (files, shapes, dtypes, rank axis).

    One line per problem would be a wall of text for a wrong preset; the first problem is the
    error (all missing files are named together, as the reference does).
    """
    if not os.path.isdir(directory):
        raise ConfigError(f"golden_data={directory}: no such directory")
    files = _files(specs)
    missing = [os.path.join(directory, sub, f"{n}.pt") for sub, n, _ in files if not os.path.isfile(os.path.join(directory, sub, f"{n}.pt"))]
    if missing:
        raise ConfigError(f"golden_data is missing files: {missing}")
    for sub, name, spec in files:
        path = os.path.join(directory, sub, f"{name}.pt")
        t = _load(path)
        want = spec.shape if _is_scalar(spec) else (tp, *spec.shape)
        if tuple(t.shape) != want or t.dtype != spec.dtype:
            lead = "" if _is_scalar(spec) else f" (leading axis = tp = {tp})"
            raise ConfigError(
                f"{path}: shape {tuple(t.shape)} dtype {t.dtype}, expected shape {want} dtype {spec.dtype}{lead}"
            )


def load_rank(directory: str, sub: str, names, rank: int, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of each named tensor of `in/` or `out/` (only that slice is read)."""
    out = {}
    for name in names:
        t = _load(os.path.join(directory, sub, f"{name}.pt"))
        out[name] = t.clone() if _is_scalar(specs[name]) else t[rank].clone()
    return out


def full_o_weights(directory: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded O weights reassembled from the stacked shards (validation.md §5.3)."""
    wo_a = _load(os.path.join(directory, "in", "wo_a.pt"))  # [P, G/P, OL, GI]
    wo_b = _load(os.path.join(directory, "in", "wo_b.pt"))  # [P, D, (G/P)*OL]
    p, d, lw = wo_b.shape
    return (
        wo_a.reshape(-1, *wo_a.shape[2:]).clone(),
        wo_b.permute(1, 0, 2).reshape(d, p * lw).contiguous(),
    )


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save(t: torch.Tensor, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save(t.contiguous(), tmp)
    os.replace(tmp, path)


def save(directory: str, case: Case, specs: dict[str, TensorSpec], inputs: dict, outputs: dict, starts: list) -> None:
    """Write a snapshot of rank-stacked `inputs` (in/) and `outputs` (out/), plus the manifest."""
    for sub in ("in", "out"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    hashes = {}
    for sub, name, spec in _files(specs):
        path = os.path.join(directory, sub, f"{name}.pt")
        t = (inputs if sub == "in" else outputs)[name]
        # Scalars are shared by the ranks and stored once, as a 0-dim tensor.
        _save(t[0] if _is_scalar(spec) else t, path)
        hashes[f"{sub}/{name}.pt"] = _sha256(path)
    manifest = {
        **case.describe(),
        "model": case.model.name,
        "model_fields": case.model.fields(),
        "start_positions_by_rank": starts,
        "tool_version": tool_version(),
        "torch": torch.__version__,
        "sha256": hashes,
    }
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
