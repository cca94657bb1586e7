"""On-disk cache of each rank's golden outputs and of the inputs they were computed from,
keyed by everything they depend on.

The identity is the case (layer, every model field, tp, local_t, seed, start positions), the
rank, the intra-op thread count (CPU GEMM blocking changes last bits), the torch version and a
hash of the `layers` package source, so an edit of any golden, fixture or component invalidates
every entry. A rank's inputs are entries of their own (`inputs_identity`), those every rank of
the group holds alike in one entry for the group: drawing them takes longer than reading them
back at every size (a flash CSA rank: 0.9 s against 0.2 s). Entries
are written atomically (temp file + rename): concurrent sweeps and xdist workers never read a
half-written entry.

An entry is trusted only when it is whole: its identity matches, it holds exactly the expected
tensors with the layer's shapes and dtypes, and each tensor's bytes match the sha256 stored
beside it. Anything else (a load error, a missing or extra name, a wrong shape, flipped bytes,
a hand-edited tensor) is a miss: the tensors are computed again and the entry overwritten. A
cache that cannot be written (read-only, a full disk, a folder that is not the harness's) never
fails a run: `store` returns why, leaves no temp file, and the run goes on with the tensors it
computed.

The folder, the entries' names and what eviction may delete are `launcher.store.cache_dir`'s:
`store` evicts whole cases, least recently used first (an entry is used when written or read:
both set its mtime), until the folder's entries fit the size cap. Deleting the folder, or any
entry of it, at any time is safe: a missing entry is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

import layers
from layers.contract.tensors import TensorSpec, tensor_sha256
from layers.contract.case import Case

from launcher.store import cache_dir


class Entry(NamedTuple):
    """A whole entry's tensors and the sha256 of each."""

    tensors: dict[str, torch.Tensor]
    sha256: dict[str, str]


# Bumped whenever the entry layout changes: older entries are then misses.
FORMAT = 3


def source_hash(root: Path) -> str:
    """A hash of every Python file under `root`, sub-packages included, with its path."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def code_version() -> str:
    return source_hash(Path(layers.__file__).parent)


def identity(case: Case, rank: int, threads: int) -> dict:
    """The identity of the golden outputs of `case` on `rank`."""
    return {
        **case.describe(),
        "model": case.model.fields(),
        "rank": rank,
        "threads": threads,
        "torch": torch.__version__,
        "code": code_version(),
    }


def inputs_identity(case: Case, rank: int | None, threads: int) -> dict:
    """The identity of the inputs (and in-outs before the step) of `case` on `rank`; with
    `rank` None, of those every rank of the group holds alike (`Layer.replicated_inputs`)."""
    return {**identity(case, 0, threads), "rank": "group" if rank is None else rank, "tensors": "inputs"}


def _entry(root: str, ident: dict) -> Path:
    return Path(root) / cache_dir.entry_name(ident)


def exists(root: str, ident: dict) -> bool:
    """Whether an entry is stored (`load` may still miss: a damaged entry is a miss)."""
    return _entry(root, ident).is_file()


def _mark_used(path: Path) -> None:
    """Stamp `path` as just used (its mtime: atime is off or lazy on many mounts). Nanoseconds
    from the clock, not the file system's coarse write time, so the order of uses is kept."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _whole(entry, ident: dict, specs: Mapping[str, TensorSpec]) -> Entry | None:
    """The entry's tensors and their digests if every check holds, else None."""
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    if entry.get("identity") != json.dumps(ident, sort_keys=True):
        return None
    tensors, digests = entry.get("tensors"), entry.get("sha256")
    if not isinstance(tensors, dict) or not isinstance(digests, dict) or set(tensors) != set(specs):
        return None
    for name, spec in specs.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            return None
        if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
            return None
        if digests.get(name) != tensor_sha256(t):
            return None
    return Entry({name: tensors[name] for name in specs}, {name: digests[name] for name in specs})


def load_entry(root: str, ident: dict, specs: Mapping[str, TensorSpec]) -> Entry | None:
    """The cached tensors named by `specs` with their sha256, or None for a miss (absent or
    not whole)."""
    path = _entry(root, ident)
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # unreadable: a miss, replaced by `store`
        return None
    whole = _whole(entry, ident, specs)
    if whole is not None:
        with contextlib.suppress(OSError):  # a read-only cache still serves its entries
            _mark_used(path)
    return whole


def load(root: str, ident: dict, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor] | None:
    """The cached tensors named by `specs`, or None for a miss."""
    whole = load_entry(root, ident, specs)
    return whole.tensors if whole is not None else None


def store(root: str, ident: dict, tensors: Mapping[str, torch.Tensor], max_bytes: int | None = None,
          sha256: Mapping[str, str] | None = None) -> str | None:
    """Write (or overwrite) the entry, then evict down to `max_bytes` (None: no cap); None when
    written and kept, else why not (an entry larger than the cap is evicted at once).
    `sha256`: the tensors' digests where the caller has them already."""
    path = _entry(root, ident)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    entry = {
        "format": FORMAT,
        "identity": json.dumps(ident, sort_keys=True),
        "tensors": dict(tensors),
        "sha256": dict(sha256) if sha256 is not None else {name: tensor_sha256(t) for name, t in tensors.items()},
    }
    try:
        cache_dir.claim(root)
        torch.save(entry, tmp)
        os.replace(tmp, path)
        _mark_used(path)
        size = path.stat().st_size
        if max_bytes is not None and path in cache_dir.evict(root, max_bytes):
            return f"evicted at once to keep the cap: the entry is {size} bytes, the cap {max_bytes} bytes"
    except Exception as e:  # OSError, torch.save's RuntimeError on a full disk, a refused folder
        with contextlib.suppress(OSError):  # no temp file may stay behind
            tmp.unlink()
        return _why_not_written(e)
    return None


def _why_not_written(e: Exception) -> str:
    """The same words on every rank for the same cause (one warning per run, not one per rank):
    no file names, no byte offsets."""
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {e.strerror or e}"
    if isinstance(e, RuntimeError):  # torch.save's own writer reports a failed write so
        return "torch.save failed (a full disk?)"
    return " ".join(f"{type(e).__name__}: {e}".split())
