"""`python -m launcher.cache info|clear`: what the golden cache holds, and emptying it.

    python -m launcher.cache info            # folder, size against the cap, entries, cases, oldest and newest use
    python -m launcher.cache clear --yes     # delete every entry (the marker and any other file stay)

The folder is the launcher's default (`$DSV4_TP_GOLDEN_CACHE`, else the XDG cache folder) unless
`--dir` names one; the cap is config.yaml's `golden_cache_max_gb` unless `--max-gb` gives one.
Only a folder marked as the harness's is listed or cleared, and only its entries
(`launcher.store.cache_dir`). Never imports torch: it runs no rank. Exit status 0, or 2 on an
error (a folder that is not a cache, `clear` without `--yes`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from importlib import resources

from omegaconf import OmegaConf

from layers.contract.config import ConfigError

from launcher.config.resolvers import golden_cache_dir
from launcher.store import cache_dir

EXIT_OK, EXIT_ERROR = 0, 2


def default_cap_gb() -> float | None:
    """config.yaml's `golden_cache_max_gb` (the cap a run gets when it names none)."""
    config = OmegaConf.load(resources.files("configs").joinpath("config.yaml").open())
    return config.golden_cache_max_gb


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="seconds")


def info(root: str, cap_gb: float | None) -> list[str]:
    """The lines `info` prints."""
    listed = cache_dir.listing(root)
    cases = listed.cases()
    cap = "no cap" if cap_gb is None else f"cap {cache_dir.gb(int(cap_gb * 1e9))}"
    lines = [f"golden cache: {root}",
             f"size: {cache_dir.gb(listed.size)} ({cap}); {len(listed.entries)} entries of {len(cases)} cases"]
    if cases:
        lines.append(f"oldest use: {_when(cases[0][1])}, newest use: {_when(cases[-1][1])}")
    if listed.temps:
        lines.append(f"{len(listed.temps)} temp files of writers ({len(listed.stale_temps(time.time_ns()))} stale, "
                     f"deleted by `clear` or the next eviction)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.cache", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["info", "clear"])
    parser.add_argument("--dir", help="the cache folder (default: the launcher's, %(default)s)", default=golden_cache_dir())
    parser.add_argument("--max-gb", type=float, help="the cap to compare against (default: config.yaml's)")
    parser.add_argument("--yes", action="store_true", help="clear: delete without asking")
    args = parser.parse_args(argv)
    root = os.path.abspath(os.path.expanduser(args.dir))
    if not os.path.isdir(root):
        print(f"no golden cache at {root} (the first run that uses it creates it)")
        return EXIT_OK
    if not cache_dir.is_marked(root) and args.command == "clear" and args.yes:
        try:  # a folder of an earlier version's entries only: adopted, those entries deleted
            cache_dir.claim(root)
        except ConfigError:
            pass  # not the harness's: refused below
    if not cache_dir.is_marked(root):
        old = cache_dir.legacy_files(root)
        hint = (f"; it holds {len(old)} entries of an earlier version ({cache_dir.gb(sum(p.stat().st_size for p in old))}), "
                f"never read again: `clear --yes` deletes them" if old else "")
        print(f"error: {root} is not a golden cache folder (no {cache_dir.MARKER} in it): nothing of it is "
              f"listed or deleted{hint}", file=sys.stderr)
        return EXIT_ERROR
    if args.command == "info":
        print("\n".join(info(root, args.max_gb if args.max_gb is not None else default_cap_gb())))
        return EXIT_OK
    if not args.yes:
        listed = cache_dir.listing(root)
        print(f"error: clear would delete {len(listed.entries)} entries ({cache_dir.gb(listed.size)}) in {root}; "
              f"add --yes to delete them", file=sys.stderr)
        return EXIT_ERROR
    count, freed = cache_dir.clear(root)
    print(f"deleted {count} files ({cache_dir.gb(freed)}) from {root}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
