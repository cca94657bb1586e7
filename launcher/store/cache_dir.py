"""The golden cache's folder: whose it is, what its entries are called, and what may be deleted.

Torch-free (`python -m launcher.cache` and the launcher's end-of-run line use it without
loading torch); `launcher.store.golden_cache` writes and reads the entries themselves.

A folder is the harness's when it holds the marker file `MARKER`, written when the cache is
created (`claim`). Only a marked folder's own entries are ever deleted: files named by
`entry_name` (`ENTRY`), and the temp files of their writers (`TEMP`) once stale (a writer that
crashed or was killed left them). Anything else in the folder is never touched.

`claim` refuses, with a ConfigError before any rank starts, a folder that is not marked and
holds files of its own (a user's folder: a size cap would otherwise delete their `*.pt`), and
the home folder, the current folder and their parents even when empty: those always hold, or
soon will, a user's files, and a cache needs a folder of its own. Entries named by earlier
versions (`LEGACY`) can never be read again: a folder holding only those is adopted and they
are deleted.

Entries are grouped by case (`entry_name`'s case key: every rank's golden and inputs and the
group's inputs of one case and thread count): eviction removes whole cases, least recently
used first (a case's last use is its newest entry's mtime), so a later run of a case finds
all of its ranks' entries or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from layers.contract.config import ConfigError

MARKER = ".dsv4-tp-harness-golden-cache"
_MARKER_TEXT = ("This folder is the golden cache of dsv4-tp-harness. Its entries (*.pt) may be deleted at any "
                "time; `python -m launcher.cache clear --yes` deletes them.\n")
_NAME = r"(?P<layer>[a-z0-9_]+)-(?P<size>[a-z]+\w*)-c(?P<case>[0-9a-f]{16})-(?P<who>r\d+|group)(?P<kind>-inputs)?-[0-9a-f]{32}\.pt"
ENTRY = re.compile(_NAME + "$")
TEMP = re.compile(_NAME + r"\.\d+\.tmp$")
LEGACY = re.compile(r"[a-z0-9_]+-[a-z]+\w*-(r\d+|group)(-inputs)?-[0-9a-f]{32}\.pt(\.\d+\.tmp)?$")
# A writer's temp file older than this is a crashed writer's: a flash-size entry takes seconds.
STALE_TEMP_S = 3600


def entry_name(ident: dict) -> str:
    """The file name of the entry of identity `ident` (`golden_cache.identity`,
    `inputs_identity`): its case key hashes everything but the rank and the entry's kind."""
    def digest(d: dict, n: int) -> str:
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:n]

    case = digest({k: v for k, v in ident.items() if k not in ("rank", "tensors")}, 16)
    size = f"tp{ident['tp']}" if "tp" in ident else f"ep{ident.get('ep')}"
    who = f"r{ident['rank']}" if isinstance(ident["rank"], int) else ident["rank"]
    kind = f"-{ident['tensors']}" if "tensors" in ident else ""
    return f"{ident['layer']}-{size}-c{case}-{who}{kind}-{digest(ident, 32)}.pt"


def _ours(name: str) -> bool:
    # The marker too: another process may claim the folder between our look and our listing.
    return name == MARKER or bool(ENTRY.fullmatch(name) or TEMP.fullmatch(name) or LEGACY.fullmatch(name))


def is_marked(root: str) -> bool:
    return os.path.isfile(os.path.join(root, MARKER))


def _protected(root: Path) -> str | None:
    """Why `root` can never be a cache folder, or None."""
    for name, folder in (("the home folder", Path.home()), ("the current folder", Path.cwd())):
        with contextlib.suppress(OSError):
            folder = folder.resolve()
            if root == folder:
                return f"is {name}"
            if root in folder.parents:
                return f"holds {name} ({folder})"
    return None


def claim(root: str) -> None:
    """Make `root` the harness's cache folder: created with its marker if new or empty, kept if
    marked. ConfigError for a folder that is not the harness's to fill (see the module's
    docstring); OSError when it cannot be created or marked (the caller warns and goes on)."""
    path = Path(root)
    if is_marked(root):
        return
    why = _protected(path.resolve())
    if why is None and path.is_dir():
        foreign = sorted(p.name for p in path.iterdir() if not _ours(p.name))
        if foreign:
            why = f"holds files the harness did not write ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
    if why is not None:
        raise ConfigError(f"golden_cache={root} {why} and is not a golden cache folder (no {MARKER} in it): "
                          f"the cache deletes its old entries, so it needs a folder of its own; name a new or "
                          f"empty folder (e.g. golden_cache={os.path.join(root, 'dsv4-golden-cache')}), or "
                          f"golden_cache=null")
    path.mkdir(parents=True, exist_ok=True)
    for old in legacy_files(root):  # never read again
        with contextlib.suppress(OSError):
            old.unlink()
    (path / MARKER).write_text(_MARKER_TEXT)


def legacy_files(root: str) -> list[Path]:
    """The entries (and temp files) an earlier version named otherwise, in `root`."""
    return sorted(p for p in Path(root).iterdir() if LEGACY.fullmatch(p.name))


@dataclass(frozen=True)
class Found:
    path: Path
    case: str  # the case key; a temp file's is its entry's
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Listing:
    """A marked folder's entries (least recently used first) and its writers' temp files."""

    entries: list[Found]
    temps: list[Found]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.entries)

    def cases(self) -> list[tuple[str, int, list[Found]]]:
        """(case key, last use, entries) per case, least recently used first."""
        by_case: dict[str, list[Found]] = {}
        for f in self.entries:
            by_case.setdefault(f.case, []).append(f)
        return sorted(((k, max(f.mtime_ns for f in fs), fs) for k, fs in by_case.items()), key=lambda c: (c[1], c[0]))

    def stale_temps(self, now_ns: int) -> list[Found]:
        return [f for f in self.temps if now_ns - f.mtime_ns > STALE_TEMP_S * 10**9]


def listing(root: str) -> Listing:
    """What `root` holds of the cache's own (nothing when it is not marked): a file that
    vanishes while listed is skipped, anything not a regular file is not an entry."""
    entries, temps = [], []
    if is_marked(root):
        with os.scandir(root) as it:
            for e in it:
                match = ENTRY.fullmatch(e.name) or TEMP.fullmatch(e.name)
                if match is None:
                    continue
                with contextlib.suppress(OSError):
                    if e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        found = Found(Path(e.path), match["case"], st.st_size, st.st_mtime_ns)
                        (entries if match.re is ENTRY else temps).append(found)
    return Listing(sorted(entries, key=lambda f: (f.mtime_ns, f.path.name)), temps)


def _unlink(path: Path) -> bool:
    """Delete `path`; False when another process deleted it first."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def evict(root: str, max_bytes: int) -> list[Path]:
    """Delete stale temp files, then whole cases, least recently used first, until the rest fit
    in `max_bytes`; the entries deleted. Another process may be evicting too: an entry already
    gone is not an error."""
    listed = listing(root)
    for f in listed.stale_temps(time.time_ns()):
        with contextlib.suppress(OSError):
            _unlink(f.path)
    total, removed = listed.size, []
    for _, _, files in listed.cases():
        if total <= max_bytes:
            break
        for f in files:
            if _unlink(f.path):
                removed.append(f.path)
            total -= f.size
    return removed


def clear(root: str) -> tuple[int, int]:
    """Delete every entry of a marked folder and its stale temp files (the marker and anything
    else stay); (files deleted, bytes freed)."""
    listed = listing(root)
    count = freed = 0
    for f in listed.entries + listed.stale_temps(time.time_ns()):
        if _unlink(f.path):
            count, freed = count + 1, freed + f.size
    return count, freed


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def usage_line(root: str | None, max_bytes: int | None) -> str | None:
    """One line for the end of a run once the cache holds more than half its cap (None below
    that, without a cap or a cache): its size, cap and folder, and how to empty it."""
    if root is None or max_bytes is None:
        return None
    try:
        size = listing(root).size
    except OSError:  # a cache that cannot be listed has no size to report
        return None
    if size <= max_bytes / 2:
        return None
    return (f"golden cache: {gb(size)} of its {gb(max_bytes)} cap in {root} (least recently used cases are "
            f"evicted beyond it); `python -m launcher.cache clear --yes` empties it")
