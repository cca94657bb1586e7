"""`python -m launcher ...`: compose the config, check it, launch the ranks, report, exit.

Exit status: 0 when every compared tensor passed, 1 on a mismatch (FAIL), 2 on any error
(invalid config, a crashed or hung rank, an implementation that broke the contract).
A multirun (`-m`) runs its jobs one after another, each with its own ranks; no job's failure
or crash stops the others (unless fail_fast=true) and the exit status is the worst job's.
Under a parallel Hydra launcher (joblib) each running job holds a job slot, its own share of
the node's cores and devices (`launcher.config.job_slot`).
Every job leaves `<output_dir>/result.json` and its page `report.html`, whatever its outcome.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

import hydra
import hydra_plugins
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from layers.contract.config import ConfigError

from launcher import sweep_config
from launcher.config import output_dirs
from launcher.config.job_slot import JobSlot, job_slot, runs_in_a_pool, slot_count
from launcher.config.one_composition import composed_once
from launcher.config.slurm import node_output_dir
from launcher.config.spec import config_case
from launcher.report import console, plots, progress, sweep
from launcher.report.result import (
    EXIT_ERROR,
    EXIT_PASS,
    build_result,
    exit_code,
    launcher_error,
    not_launched,
)
from launcher.report.run_page import write_result_and_page
from launcher.run import devices, job_process, rank_group, slots, tee
from launcher.run.launch import launch
from launcher.run.preflight import preflight
from launcher.store import cache_dir


# Written to the run's launcher.log only (Hydra's job logging; the console shows warnings).
log = logging.getLogger("launcher")


def execute(cfg: DictConfig, output_dir: str, job: dict | None = None, overrides: list[str] | None = None,
            slot: JobSlot | None = None) -> int:
    """Run one case; never raises (an exception of the launcher itself is an ERROR result), so
    that one job cannot take a sweep's other jobs down. `job`: the sweep job's entry
    (`launcher.report.sweep.job_entry`), recorded in result.json; `overrides`: the run's
    override strings (the keys the user gave explicitly); `slot`: the share of the node a job
    running beside others holds (None: the whole node)."""
    t0 = time.perf_counter()
    try:
        return _execute(cfg, output_dir, t0, job, overrides, slot)
    except Exception as e:  # anything at all: the job is reported and the sweep goes on
        result = launcher_error(config_case(cfg), e, wall_s=time.perf_counter() - t0)
        written, unwritten = _write(output_dir, result, job)
        print(console.render(result))
        print(console.where_line(output_dir, written))
        if unwritten:
            print(unwritten, file=sys.stderr)
        return EXIT_ERROR


def _write(output_dir: str, result: dict, job: dict | None) -> tuple[dict, str | None]:
    """Write the run's result.json and page; the result as written (as given when it could not
    be) and None, or the error line to print when the output folder cannot take them (a full
    disk, a read-only mount): the run is then an error, its report on the console its only record."""
    try:
        return write_result_and_page(output_dir, result, job), None
    except OSError as e:
        return result, (f"error: output folder {output_dir}: {os.path.basename(e.filename or 'result.json')} cannot "
                        f"be written ({e.strerror or e}); the report above is this run's only record")


def _execute(cfg: DictConfig, output_dir: str, t0: float, job: dict | None, overrides: list[str] | None,
             slot: JobSlot | None) -> int:
    log.info("command line: %s", " ".join(sys.argv[1:]))
    if node_output_dir(output_dir, os.environ) != output_dir:
        # Node k > 0 of a Slurm job: only node 0's result (the compared one) is the sweep job's.
        output_dir, job = node_output_dir(output_dir, os.environ), None
    try:
        spec = preflight(cfg, output_dir, overrides, slot)
    except (ConfigError, OmegaConfBaseException) as e:  # a value that cannot be read is a config error too
        message = " ".join(str(e).split())
        log.info("refused: %s", message)
        print(f"error: {message}", file=sys.stderr)
        written, unwritten = _write(output_dir, not_launched(config_case(cfg), "config-error", message,
                                                             wall_s=time.perf_counter() - t0, stage="config"), job)
        if job is None:  # a sweep's job: its row in the sweep's table says it; stderr keeps its one error line
            print(console.where_line(output_dir, written))
        if unwritten:
            print(unwritten, file=sys.stderr)
        return EXIT_ERROR
    # The ranks append to their progress files: a folder reused from an earlier run starts empty.
    shutil.rmtree(os.path.join(output_dir, "progress"), ignore_errors=True)
    if spec.snapshot:
        print(console.snapshot_line(spec.snapshot, spec.case_entry()), flush=True)
    c = spec.case
    size = f"tp={c.tp} local_t={c.local_t}" if "tp" in c.describe() else f"ep={c.group_size}"
    label = f"{c.layer} {c.model.name} {size}{f' dp={spec.dp}' if spec.dp > 1 else ''}"
    log.info("launching %s: %d ranks on this node (node %d of %d), threads per rank %d, %s, output %s",
             label, spec.local_ranks, spec.node_rank, spec.nnodes, spec.threads(),
             spec.slot.describe() if spec.slot else "the whole node", output_dir)
    if spec.bench:
        plots.preload_in_background()
    with progress.StageWatcher(output_dir, spec.local_ranks, label):
        outcome = launch(spec)
    result = build_result(spec, rank_result=outcome.result, error=outcome.error, log_dir=outcome.log_dir,
                          wall_s=time.perf_counter() - t0)
    if spec.report_plots:
        result["plots"] = plots.write_plots(result, output_dir)
    written, unwritten = _write(output_dir, result, job)
    report = console.render(result)
    log.info("report:\n%s", report)
    status = EXIT_ERROR if unwritten else exit_code(result)
    log.info("exit status %d", status)
    if job is None or status != EXIT_PASS:  # a sweep's passing job: its one progress row says it
        print(report)
        print(console.where_line(output_dir, written))
    cache_usage = cache_dir.usage_line(spec.golden_cache, spec.golden_cache_max_bytes) if job is None else None
    if cache_usage:
        print(cache_usage)
    if unwritten:
        print(unwritten, file=sys.stderr)
    if outcome.interrupted:  # stop here, a sweep included, with the shell's 128 + signal status
        raise SystemExit(128 + outcome.interrupted)
    return status


class OutputFolder(Callback):
    """Creates the run's (or the sweep's) output folder before Hydra does and claims it for
    this launcher (`launcher.config.output_dirs.claim`, this node's folder of a Slurm job): one
    that cannot be created or written, whose disk is (nearly) full, or that another launcher
    holds, is refused with one line and exit status 2, before Hydra writes anything into it."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _create_output_folder(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _create_output_folder(config, "hydra.sweep.dir")


# Free space an output folder needs: Hydra's copies of the config, launcher.log, every rank's
# logs, result.json and report.html (a tiny run: about 50 kB; a failing flash run's logs and
# page more).
MIN_FREE_BYTES = 1 << 20


def _create_output_folder(config: DictConfig, key: str) -> None:
    progress.composition_done()  # the error line goes to the terminal
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


@hydra.main(config_path="pkg://configs", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> int:
    progress.composition_done()
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return execute(cfg, output_dir, overrides=overrides)
    num = int(hydra_cfg.job.num)
    job = sweep.job_entry(hydra_cfg.sweep.dir, num, overrides)
    if cfg.fail_fast and sweep.earlier_job_failed(hydra_cfg.sweep.dir, num):
        # Not counted in the exit status: the job that did not pass already decides it.
        message = "not run: fail_fast=true and an earlier job of this sweep did not pass"
        write_result_and_page(output_dir, not_launched(config_case(cfg), "skipped", message, wall_s=0.0), job)
        return EXIT_ERROR
    return _execute_sweep_job(cfg, output_dir, job, overrides, hydra_cfg)


def _execute_sweep_job(cfg: DictConfig, output_dir: str, job: dict, overrides: list[str], hydra_cfg) -> int:
    """A sweep's job; under a launcher that runs the jobs in a pool of worker processes, in the
    worker's job process (`launcher.run.job_process`): its death is its own ERROR, not the pool's."""
    sweep_dir, launcher = str(hydra_cfg.sweep.dir), OmegaConf.to_container(hydra_cfg.launcher)
    if not runs_in_a_pool(launcher):
        return _execute_in_slot(cfg, output_dir, job, overrides, sweep_dir, launcher)
    job_process.die_with_sweep()
    t0 = time.perf_counter()
    status, how = job_process.JOB_PROCESS.run(_execute_in_slot, cfg, output_dir, job, overrides, sweep_dir, launcher)
    written = _result_of(output_dir, job)
    if written is None:
        message = (f"the job's process {how} before it wrote its result (a signal, the OOM killer, or an "
                   f"implementation that ended it); its ranks ended with it")
        written = write_result_and_page(output_dir, not_launched(config_case(cfg), "error", message, stage="launcher",
                                                                 wall_s=time.perf_counter() - t0), job)
        print(console.render(written))
    if status in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # interrupted: the sweep stops, as it would here
        raise SystemExit(status)
    return exit_code(written) if status is None else status


def _result_of(output_dir: str, job: dict) -> dict | None:
    """The result.json this sweep job wrote into `output_dir`, if it did."""
    try:
        with open(os.path.join(output_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if result.get("job") == job else None


def _execute_in_slot(cfg: DictConfig, output_dir: str, job: dict, overrides: list[str], sweep_dir: str,
                     launcher: dict) -> int:
    """A sweep's job: in a job slot of its own while the launcher runs several jobs at once on
    this node (`launcher.config.job_slot`), else with the whole node."""
    cpus = devices.cpu_affinity()
    planned = (sweep.read_record(sweep_dir) or {}).get("jobs")
    planned_n = len(planned) if planned is not None else None
    if cpus is None or slot_count(launcher, planned_n, len(cpus), None) == 1:
        return execute(cfg, output_dir, job, overrides)
    try:
        device_env, node_devices = devices.node_devices()
    except Exception as e:  # a broken accelerator runtime: this job's ERROR, not a job without a result
        write_result_and_page(output_dir, launcher_error(config_case(cfg), e, wall_s=0.0), job)
        return EXIT_ERROR
    count = slot_count(launcher, planned_n, len(cpus), len(node_devices) if node_devices is not None else None)
    # Held until the job's result is written; released whatever happens, the job's death included.
    with slots.claim(os.path.abspath(sweep_dir), count, job["num"]) as index:
        return execute(cfg, output_dir, job, overrides, job_slot(index, count, cpus, node_devices, device_env))


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


VERBOSE_FLAGS = ("-v", "--verbose")


def main() -> None:
    """Run Hydra; a composition error (unknown key, bad value, unknown option) is one line, exit 2."""
    sweep.SweepSummary.exit_status = sweep.SweepSummary.unfinished_sweep = None
    verbose = [a for a in sys.argv[1:] if a in VERBOSE_FLAGS]
    if verbose:  # ours, not Hydra's: rank 0's INFO records on the console too
        sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in VERBOSE_FLAGS)]
        tee.show_log_records()
    if sweep_config.wants_sweep_configs(sys.argv[1:]):  # Hydra itself refuses -m with --cfg
        sys.exit(_print_sweep_configs(sys.argv[1:]))
    sys.argv += basic_plugins_if_ours_are_hidden(sys.argv[1:])
    progress.hold_stderr_while_composing()
    code = None
    try:
        with composed_once(sys.argv[1:]):
            _hydra_main()
    except SystemExit as e:
        code = e.code
    except Exception as e:  # Hydra's own refusal of the command line, e.g. -m with --cfg
        progress.composition_error()
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        code = EXIT_ERROR
    rank_group.POOL.close()  # the warm ranks a sweep's last jobs left
    held = progress.composition_error()
    if held is not None and code:
        print(f"error: {one_line(held)}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    if held:
        sys.stderr.write(held)  # only printed (--help, --cfg): nothing failed
    sys.exit(final_status(code))


def basic_plugins_if_ours_are_hidden(argv: list[str]) -> list[str]:
    """Hydra finds plugins by walking the `hydra_plugins` namespace's folders. An editable
    install in setuptools' strict mode (`pip install -e .`) serves the namespace through an
    import hook that Hydra's walk cannot list, so the harness's sweeper and launcher
    (`hydra_plugins.dsv4_tp_harness`) would be unknown to it: a multirun then takes Hydra's
    basic pair (the same jobs, composed twice), with a warning saying how to get ours."""
    if not any(a in ("-m", "--multirun") for a in argv) or any(
            os.path.isfile(os.path.join(p, "dsv4_tp_harness", "sweep.py")) for p in hydra_plugins.__path__):
        return []
    chosen = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    basic = [f"{group}=basic" for group in ("hydra/sweeper", "hydra/launcher") if group not in chosen]
    if basic:
        print("warning: Hydra cannot see the harness's sweeper plugin (an editable install in setuptools' strict "
              "mode hides it): this sweep uses Hydra's basic sweeper and launcher, which compose every job twice; "
              "`pip install -e . --config-settings editable_mode=compat` (or `pip install .`) makes it visible",
              file=sys.stderr)
    return basic


def _print_sweep_configs(argv: list[str]) -> int:
    try:
        refusal = sweep_config.print_sweep_configs(argv)
    except Exception as e:  # a composition error: an unknown key, a bad value
        refusal = one_line(str(e))
    if refusal is None:
        return EXIT_PASS
    print(f"error: {refusal}", file=sys.stderr)
    return EXIT_ERROR


def final_status(code) -> int:
    """The process's exit status, from the files the run or the sweep's jobs wrote.

    `code`: how Hydra's application ended (None: normally; 128 + a signal: interrupted; else
    Hydra's own error exit). A multirun that never reached its end still gets its summary:
    interrupted, its unfinished jobs are skips and the status is the signal's; stopped by an
    error (a Hydra launcher that failed), the status is at least an error.
    """
    unfinished = sweep.SweepSummary.unfinished_sweep
    interrupted = code in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    if unfinished is not None:
        status = sweep.write_summary(unfinished, interrupted=interrupted)
        return code if interrupted else max(status, EXIT_ERROR)
    if code:
        return code if isinstance(code, int) else EXIT_ERROR
    status = sweep.SweepSummary.exit_status
    return EXIT_PASS if status is None else status  # None: nothing ran (--help, --cfg print only)
