"""The command line's primary config composed once, where Hydra would compose it twice.

Hydra's application entry first composes the config only to read `hydra.mode` (`Hydra.get_mode`,
in multirun mode and without checking sweep overrides), then composes it again to run or to
sweep, with `hydra.mode=RUN` (or `MULTIRUN`) appended to the overrides when the config left
the mode unset. A composition of the harness's config costs 0.08 to 0.1 s, a twentieth of a
whole tiny run. Inside `composed_once`, the first composition is done the way the second
will be (the run mode the command line asks for, every check on), and the second call hands
it back, with Hydra's appended mode override applied as Hydra applies it. Whatever does not
match exactly is composed by Hydra as before: a first composition that fails (Hydra's own
`get_mode` runs then), a call with other arguments or overrides, any later call (the memo is
handed out once).

Hydra 1.3's internals (`Hydra.get_mode`, `ConfigLoaderImpl.load_configuration`): a Hydra
without them, or one that calls them with arguments this does not know, composes as it
does. The test suite composes every command-line form with and without this and compares
the configs.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Iterator, Optional

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig


@dataclass
class _Composed:
    config_name: Optional[str]
    overrides: list[str]
    run_mode: RunMode
    cfg: DictConfig


def run_mode_of(argv: list[str]) -> RunMode:
    """The mode Hydra's own command-line parser reads from `argv` (-m / --multirun); RUN for
    a command line it refuses (Hydra's entry reports that, once)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(argv)
    except SystemExit:
        return RunMode.RUN
    return RunMode.MULTIRUN if args.multirun else RunMode.RUN


@contextlib.contextmanager
def composed_once(argv: list[str]) -> Iterator[None]:
    """Within the block, Hydra's entry composes the primary config of `argv` once."""
    hydra_get_mode = getattr(Hydra, "get_mode", None)
    hydra_load = getattr(ConfigLoaderImpl, "load_configuration", None)
    if hydra_get_mode is None or hydra_load is None:  # a Hydra of another shape composes as it does
        yield
        return
    run_mode = run_mode_of(argv)
    kept: list[_Composed] = []

    def get_mode(hydra, config_name, overrides, *args, **kwargs):
        if args or kwargs:  # a Hydra that asks for more than this knows of
            return hydra_get_mode(hydra, config_name, overrides, *args, **kwargs)
        try:
            cfg = hydra_load(hydra.config_loader, config_name=config_name, overrides=list(overrides), run_mode=run_mode)
        except Exception:  # Hydra reads the mode its own way and reports the error later
            return hydra_get_mode(hydra, config_name, overrides)
        kept.append(_Composed(config_name, list(overrides), run_mode, cfg))
        return cfg.hydra.mode

    def load_configuration(loader, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True,
                           **kwargs):
        first = kept.pop() if kept else None
        if first is not None and from_shell and validate_sweep_overrides and not kwargs:
            cfg = _handed_back(first, config_name, list(overrides), run_mode)
            if cfg is not None:
                return cfg
        return hydra_load(loader, config_name=config_name, overrides=overrides, run_mode=run_mode,
                          from_shell=from_shell, validate_sweep_overrides=validate_sweep_overrides, **kwargs)

    Hydra.get_mode, ConfigLoaderImpl.load_configuration = get_mode, load_configuration
    try:
        yield
    finally:
        Hydra.get_mode, ConfigLoaderImpl.load_configuration = hydra_get_mode, hydra_load


def _handed_back(first: _Composed, config_name: Optional[str], overrides: list[str],
                 run_mode: RunMode) -> DictConfig | None:
    """`first`'s config where the call asks for it: the same config, mode and overrides, or
    those with the one `hydra.mode=<mode>` Hydra appends when the config leaves it unset."""
    n = len(first.overrides)
    if config_name != first.config_name or run_mode != first.run_mode or overrides[:n] != first.overrides:
        return None
    appended = overrides[n:]
    if not appended:
        return first.cfg
    if appended != [f"hydra.mode={run_mode.name}"] or first.cfg.hydra.mode is not None:
        return None
    # What Hydra's composition does with a trailing non-group override of its own config.
    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(appended), first.cfg)
    first.cfg.hydra.overrides.hydra.append(appended[0])
    return first.cfg
