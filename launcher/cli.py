"""`python -m launcher ...`: compose the config, check it, launch the ranks, report, exit.

Exit status: 0 when every compared tensor passed, 1 on a mismatch (FAIL), 2 on any error
(invalid config, a crashed or hung rank, an implementation that broke the contract).
A multirun (`-m`) runs its jobs one after another, each with its own ranks; no job's failure
or crash stops the others (unless fail_fast=true) and the exit status is the worst job's.
Under a parallel Hydra launcher (joblib) each running job holds a job slot, its own share of
the node's cores and devices (`launcher.config.job_slot`).
Every job of a sweep leaves `<output_dir>/result.json` and its page `report.html`, whatever its
outcome; so does a single run once it starts (a config it refuses is one error line, no folder).

This module is the front door: help, --cfg, shell completion and composition errors end here,
without importing torch or the layers. The run itself is `launcher.job`, imported when a run or
a sweep starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import string
import sys
import tempfile
from typing import TYPE_CHECKING

import hydra
import hydra_plugins
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from layers.contract.config import ConfigError

from launcher import sweep_config
from launcher.config import output_dirs
from launcher.config.schema import refused_overrides
from launcher.config.slurm import node_output_dir
from launcher.config.spec import check_config
from launcher.report import progress
from launcher.report.exit_codes import EXIT_ERROR, EXIT_PASS
from launcher.run import import_gc, tee
from launcher.store.snapshot_layer import with_snapshot_layer

if TYPE_CHECKING:
    from launcher.run.rank_group import GroupPool


class RunStart(Callback):
    """A run or a sweep starts: a single run's config is checked as far as it can be without
    torch (`launcher.config.spec.check_config`), its modules are imported (`launcher.job`:
    torch, the layers), it is checked whole (a refusal is one error line, before any folder
    exists), and the output folder is created before Hydra does and claimed for this launcher
    (`launcher.config.output_dirs.claim`, this node's folder of a Slurm job): one that cannot be
    created or written, whose disk is (nearly) full, or that another launcher holds, is refused
    with one line and exit status 2, before Hydra writes anything into it."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        progress.composition_done()  # the error line goes to the terminal
        _check_config(config)
        _import_the_run().check_before_folder(config)
        _create_output_folder(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _import_the_run()  # imported, it also tells final_status that a sweep started
        progress.composition_done()
        _create_output_folder(config, "hydra.sweep.dir")


def _check_config(config: DictConfig) -> None:
    """A config that its own keys and case refuse is refused here, one error line, before the
    run's modules (torch, the layers' compute) are imported; the rest is the preflight's."""
    try:
        check_config(config)
    except (ConfigError, OmegaConfBaseException) as e:  # a value that cannot be read is a config error too
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def _import_the_run():
    """`launcher.job`, imported here, not above: nothing that only prints or refuses imports
    torch. Its imports make objects that live as long as the process: the collector is paused
    meanwhile, as for the launcher's own imports (`launcher.run.import_gc`)."""
    import_gc.pause()
    from launcher import job

    import_gc.resume()
    return job


# Free space an output folder needs: Hydra's copies of the config, launcher.log, every rank's
# logs, result.json and report.html (a tiny run: about 50 kB; a failing flash run's logs and
# page more).
MIN_FREE_BYTES = 1 << 20


def _create_output_folder(config: DictConfig, key: str) -> None:
    folder = key
    try:
        folder = str(OmegaConf.select(config, key))  # claims a ${fresh_dir:...} folder
        if key == "hydra.run.dir":
            folder = node_output_dir(folder, os.environ)
        output_dirs.claim(folder)
        with tempfile.TemporaryFile(dir=folder) as probe:  # a read-only mount, a full disk
            probe.write(bytes(4096))
            probe.flush()
            os.fsync(probe.fileno())
        free = shutil.disk_usage(folder).free
        if free >= MIN_FREE_BYTES:
            return
        why = (f"{key}: {folder} has {free} bytes free on its disk, under the {MIN_FREE_BYTES} a run writes; "
               f"free some space or choose another folder")
    except (OSError, OmegaConfBaseException, ConfigError) as e:
        cause = e
        while cause is not None and not isinstance(cause, (OSError, ConfigError)):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, OSError):
            why = f"{key}: {cause.filename or folder} cannot be written ({cause.strerror}); choose a writable folder"
        else:
            why = " ".join(str(cause or e).split())
    print(f"error: {why}", file=sys.stderr)
    raise SystemExit(EXIT_ERROR)


@dataclasses.dataclass
class ProcessRuns:
    """What the runs of this launcher process share, owned by `main`: each job's exit status
    (`hydra.main` drops what its task returns) and the warm rank groups jobs leave for the next
    (`launcher.run.rank_group.GroupPool`, made by the first run: its import is torch's)."""

    statuses: list[int] = dataclasses.field(default_factory=list)
    pool: GroupPool | None = None


def _hydra_main(runs: ProcessRuns):
    """Hydra's application, its runs recorded in `runs`."""

    @hydra.main(config_path="pkg://configs", config_name="config", version_base=None)
    def task(cfg: DictConfig) -> int:
        from launcher.job import run_job  # imported by RunStart already: a run started
        from launcher.run.rank_group import GroupPool

        progress.composition_done()
        if runs.pool is None:
            runs.pool = GroupPool()
        runs.statuses.append(run_job(cfg, HydraConfig.get(), runs.pool))
        return runs.statuses[-1]

    return task


def one_line(hydra_message: str) -> str:
    """Hydra's multi-line composition error as one line (its hints about env vars dropped)."""
    keep = []
    for line in hydra_message.splitlines():
        line = line.strip()
        if line.startswith(("Set the environment variable", "Config search path", "Traceback")):
            break
        if line and not line.startswith(("full_key:", "object_type=", "reference_type=")):
            keep.append(line)
    return " ".join(keep)


# Hydra's flags that take the next argument as their value (`--cfg job`, `-sc install=bash`).
_FLAGS_WITH_VALUE = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
                     "-cd", "--config-dir", "-sc", "--shell-completion", "--info", "--experimental-rerun")


def command_line_overrides(argv: list[str]) -> list[str]:
    """The `key=value` overrides of a command line, without Hydra's flags and their values."""
    return [a for prev, a in zip([""] + argv, argv)
            if not a.startswith("-") and prev not in _FLAGS_WITH_VALUE and "=" in a]


VERBOSE_FLAGS = ("-v", "--verbose")


def main() -> None:
    """Run Hydra; a composition error (unknown key, bad value, unknown option) is one line, exit 2."""
    if any(a in VERBOSE_FLAGS for a in sys.argv[1:]):  # ours, not Hydra's: rank 0's INFO records on the console too
        sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in VERBOSE_FLAGS)]
        tee.show_log_records()
    if not any(a in ("-sc", "--shell-completion") or a.startswith("--shell-completion=") for a in sys.argv[1:]):
        given = command_line_overrides(sys.argv[1:])
        sys.argv += with_snapshot_layer(given)[len(given):]  # a replay composes its snapshot's layer group
        try:
            refusal = refused_overrides(command_line_overrides(sys.argv[1:]))
        except Exception:  # an override Hydra cannot parse: Hydra's own error line says why
            refusal = None
        if refusal is not None:
            print(f"error: {refusal}", file=sys.stderr)
            sys.exit(EXIT_ERROR)
    if sweep_config.wants_sweep_configs(sys.argv[1:]):  # Hydra itself refuses -m with --cfg
        sys.exit(_print_sweep_configs(sys.argv[1:]))
    if _print_help(sys.argv[1:]):
        sys.exit(EXIT_PASS)
    show_our_plugins_to_hydra()
    progress.hold_stderr_while_composing()
    code, runs = None, ProcessRuns()
    try:
        _hydra_main(runs)()
    except SystemExit as e:
        code = e.code
    except Exception as e:  # Hydra's own refusal of the command line, e.g. -m with --cfg
        progress.composition_error()
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        code = EXIT_ERROR
    held = progress.composition_error()
    if held is not None and code:
        print(f"error: {one_line(held)}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    if held:
        sys.stderr.write(held)  # only printed (--help, --cfg): nothing failed
    sys.exit(final_status(code, runs))


def show_our_plugins_to_hydra() -> None:
    """Hydra finds plugins by walking the `hydra_plugins` namespace's folders. An editable
    install (`pip install -e .`) serves our part of the namespace through setuptools' import
    hook, which that walk cannot list: the harness's sweeper and launcher
    (`hydra_plugins.dsv4_tp_harness`) would be unknown to Hydra, and a sweep would take Hydra's
    basic pair, which composes every job twice. The folder our package sits in joins the
    namespace's folders, where the walk finds it."""
    if any(os.path.isfile(os.path.join(p, "dsv4_tp_harness", "__init__.py")) for p in hydra_plugins.__path__):
        return
    spec = importlib.util.find_spec("hydra_plugins.dsv4_tp_harness")
    if spec is None or spec.origin is None:
        return
    # A list, not the namespace's live path: the folder stays whatever the import system recomputes.
    hydra_plugins.__path__ = [*hydra_plugins.__path__, os.path.dirname(os.path.dirname(spec.origin))]


def _print_help(argv: list[str]) -> bool:
    """`--help [OVERRIDES]`: the help template printed as Hydra prints it, from one composition
    (the Compose API). Hydra's own --help also lists every config group for its placeholders,
    whichever the template uses: most of a second. False (Hydra prints it) for a template
    with a placeholder other than $CONFIG, or a command line with other flags."""
    flags = [a for a in argv if a not in command_line_overrides(argv)]
    if not flags or any(a not in ("-h", "--help") for a in flags):
        return False
    try:
        with initialize_config_module(config_module="configs", version_base=None):
            cfg = compose(config_name="config", overrides=command_line_overrides(argv), return_hydra_config=True)
    except Exception as e:  # a composition error: one line, as a run's, with its cause
        print(f"error: {one_line(f'{e} {e.__cause__ or str()}')}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    template = string.Template(cfg.hydra.help.template)
    if not set(template.get_identifiers()) <= {"CONFIG"}:
        return False
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    print(template.substitute(CONFIG=OmegaConf.to_yaml(job)))
    return True


def _print_sweep_configs(argv: list[str]) -> int:
    try:
        refusal = sweep_config.print_sweep_configs(argv)
    except Exception as e:  # a composition error: an unknown key, a bad value
        refusal = one_line(str(e))
    if refusal is None:
        return EXIT_PASS
    print(f"error: {refusal}", file=sys.stderr)
    return EXIT_ERROR


def final_status(code, runs: ProcessRuns) -> int:
    """The process's exit status: `launcher.job.finish`'s once a run or a sweep started (it
    imported `launcher.job`), else Hydra's (None: only printed, --help or --cfg)."""
    job = sys.modules.get("launcher.job")
    if job is not None:
        return job.finish(code, runs.statuses[-1] if runs.statuses else None, runs.pool)
    if code:
        return code if isinstance(code, int) else EXIT_ERROR
    return EXIT_PASS
