"""On-disk cache of each rank's golden outputs, keyed by everything the golden depends on.

The identity is the case (layer, every model field, tp, local_t, seed, start positions), the
rank, the intra-op thread count (CPU GEMM blocking changes last bits), the torch version and a
hash of the `layers` package source, so an edit of any golden, fixture or component invalidates
every entry. Entries are written atomically (temp file + rename): concurrent sweeps and xdist
workers never read a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import torch

import layers
from layers.case import Case


@lru_cache(maxsize=1)
def code_version() -> str:
    h = hashlib.sha256()
    root = Path(layers.__file__).parent
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def identity(case: Case, rank: int, threads: int) -> dict:
    return {
        "layer": case.layer,
        "scope": case.scope,
        "model": case.model.fields(),
        "tp": case.tp,
        "local_t": case.local_t,
        "seed": case.seed,
        "start_pos": list(case.start_pos) if isinstance(case.start_pos, tuple) else case.start_pos,
        "rank": rank,
        "threads": threads,
        "torch": torch.__version__,
        "code": code_version(),
    }


def _entry(root: str, ident: dict) -> Path:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    return Path(root) / f"{ident['layer']}-tp{ident['tp']}-r{ident['rank']}-{key}.pt"


def exists(root: str, ident: dict) -> bool:
    """Whether an entry is stored (`load` may still miss: a damaged entry is a miss)."""
    return _entry(root, ident).is_file()


def load(root: str, ident: dict) -> dict[str, torch.Tensor] | None:
    path = _entry(root, ident)
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged entry is a miss, and is replaced
        return None
    if not isinstance(entry, dict) or entry.get("identity") != json.dumps(ident, sort_keys=True):
        return None
    return entry["outputs"]


def store(root: str, ident: dict, outputs: dict[str, torch.Tensor]) -> None:
    path = _entry(root, ident)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"identity": json.dumps(ident, sort_keys=True), "outputs": outputs}, tmp)
    os.replace(tmp, path)
