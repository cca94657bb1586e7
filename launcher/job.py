"""A run of `python -m launcher` once Hydra has composed its config: preflight, launch, report.

`launcher.cli` (the command line's front door: help, --cfg, completion, composition errors)
imports this module only when a run or a sweep starts, so that nothing that only prints or
refuses pays for torch and the layers.

A single run is checked before its output folder exists (`check_before_folder`, from the
`launcher.cli.RunStart` callback): a refused config is one error line and no folder. A sweep's
job is checked in its own folder, where its result.json records the refusal for the summary.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import time
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from layers.contract.config import ConfigError

from launcher.config.job_slot import JobSlot, job_slot, runs_in_a_pool, slot_count
from launcher.config.slurm import node_output_dir
from launcher.config.spec import RunSpec, config_case
from launcher.report import console, plots, progress, sweep_summary
from launcher.report.exit_codes import EXIT_ERROR, EXIT_PASS
from launcher.report.result import exit_code
from launcher.report.run_page import write_result_and_page
from launcher.run import devices, job_process, rank_group, slots
from launcher.run.launch import launch
from launcher.run.preflight import preflight
from launcher.run.run_result import RunResult
from launcher.store import cache_dir

# Written to the run's launcher.log only (Hydra's job logging; the console shows warnings).
log = logging.getLogger("launcher")


class CheckedRun:
    """The spec a single run's preflight read before its folder was created, taken by the run
    (Hydra calls the run-start callback, then the task function, in this process)."""

    spec: ClassVar[RunSpec | None] = None


def _message(e: Exception) -> str:
    return " ".join(str(e).split())


def check_before_folder(config: DictConfig) -> None:
    """Preflight of a single run's composed config (with its `hydra` node), before anything is
    written: a refusal is one error line and exit status 2, and no output folder."""
    task_cfg = copy.deepcopy(config)
    with open_dict(task_cfg):
        del task_cfg["hydra"]
    try:
        CheckedRun.spec = preflight(task_cfg, output_dir="", overrides=list(config.hydra.overrides.task))
    except (ConfigError, OmegaConfBaseException) as e:  # a value that cannot be read is a config error too
        print(f"error: {_message(e)}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None


def execute(cfg: DictConfig, output_dir: str, job: dict | None = None, overrides: list[str] | None = None,
            slot: JobSlot | None = None, spec: RunSpec | None = None, prefix: str = "",
            pool: rank_group.GroupPool | None = None) -> int:
    """Run one case; never raises (an exception of the launcher itself is an ERROR result), so
    that one job cannot take a sweep's other jobs down. `job`: the sweep job's entry
    (`launcher.report.sweep_summary.job_entry`), recorded in result.json; `overrides`: the run's
    override strings (the keys the user gave explicitly); `slot`: the share of the node a job
    running beside others holds (None: the whole node); `spec`: the run's spec where its
    preflight already ran (`check_before_folder`); `prefix`: a sweep job's place in its sweep
    ("[3/12] "), before its progress lines; `pool`: the warm rank groups of this process's runs
    (None: the run's ranks leave with it)."""
    t0 = time.perf_counter()
    try:
        return _execute(cfg, output_dir, t0, job, overrides, slot, spec, prefix, pool)
    except Exception as e:  # anything at all: the job is reported and the sweep goes on
        result = RunResult.launcher_error(config_case(cfg), e, wall_s=time.perf_counter() - t0).to_json()
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
             slot: JobSlot | None, spec: RunSpec | None, prefix: str, pool: rank_group.GroupPool | None) -> int:
    log.info("command line: %s", " ".join(sys.argv[1:]))
    if node_output_dir(output_dir, os.environ) != output_dir:
        # Node k > 0 of a Slurm job: only node 0's result (the compared one) is the sweep job's.
        output_dir, job = node_output_dir(output_dir, os.environ), None
    if spec is None:
        try:
            spec = preflight(cfg, output_dir, overrides, slot)
        except (ConfigError, OmegaConfBaseException) as e:  # a value that cannot be read is a config error too
            message = _message(e)
            log.info("refused: %s", message)
            print(f"error: {message}", file=sys.stderr)
            written, unwritten = _write(output_dir, RunResult.not_launched(
                config_case(cfg), "config-error", message, wall_s=time.perf_counter() - t0, phase="config").to_json(), job)
            if job is None:  # a sweep's job: its row in the sweep's table says it; stderr keeps its one error line
                print(console.where_line(output_dir, written))
            if unwritten:
                print(unwritten, file=sys.stderr)
            return EXIT_ERROR
    else:
        spec = dataclasses.replace(spec, output_dir=output_dir)
    # The ranks append to their progress files: a folder reused from an earlier run starts empty.
    shutil.rmtree(os.path.join(output_dir, "progress"), ignore_errors=True)
    if spec.snapshot:
        print(console.snapshot_line(spec.snapshot, spec.case_entry()), flush=True)
    c = spec.case
    label = f"{console.case_label(c.describe(), c.model.name)}{f' dp={spec.dp}' if spec.dp > 1 else ''}"
    log.info("launching %s: %d ranks on this node (node %d of %d), threads per rank %d, %s, output %s",
             label, spec.local_ranks, spec.node_rank, spec.nnodes, spec.threads(),
             spec.slot.describe() if spec.slot else "the whole node", output_dir)
    if spec.bench:
        plots.preload_in_background()
    with progress.PhaseWatcher(output_dir, spec.local_ranks, label, prefix=prefix):
        outcome = launch(spec, pool)
    built = RunResult.launched(spec, machine=devices.machine_entry(spec.backend, spec.local_ranks),
                               rank_result=outcome.result, error=outcome.error, log_dir=outcome.log_dir,
                               wall_s=time.perf_counter() - t0)
    if spec.report_plots:
        built.plots = plots.write_plots(built.to_json(), output_dir)
    result = built.to_json()
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


def run_job(cfg: DictConfig, hydra_cfg, pool: rank_group.GroupPool) -> int:
    """Hydra's task: the run, or one job of a multirun (`hydra_cfg`: Hydra's runtime config;
    `pool`: the warm rank groups of this process's runs)."""
    output_dir = hydra_cfg.runtime.output_dir
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode.name != "MULTIRUN":
        spec, CheckedRun.spec = CheckedRun.spec, None
        return execute(cfg, output_dir, overrides=overrides, spec=spec, pool=pool)
    num = int(hydra_cfg.job.num)
    job = sweep_summary.job_entry(hydra_cfg.sweep.dir, num, overrides)
    # In the process that runs the job's launch (the sweep's launcher, a pool's worker, a
    # Slurm task): interrupted before its result, the job reads as one that ran.
    sweep_summary.mark_started(output_dir, job)
    if cfg.fail_fast and sweep_summary.earlier_job_failed(hydra_cfg.sweep.dir, num):
        # Not counted in the exit status: the job that did not pass already decides it.
        message = "not run: fail_fast=true and an earlier job of this sweep did not pass"
        write_result_and_page(output_dir, RunResult.not_launched(config_case(cfg), "skipped", message, wall_s=0.0).to_json(),
                              job)
        return EXIT_ERROR
    return _execute_sweep_job(cfg, output_dir, job, overrides, hydra_cfg, pool)


def _execute_sweep_job(cfg: DictConfig, output_dir: str, job: dict, overrides: list[str], hydra_cfg,
                       pool: rank_group.GroupPool) -> int:
    """A sweep's job; under a launcher that runs the jobs in a pool of worker processes, in the
    worker's job process (`launcher.run.job_process`): its death is its own ERROR, not the pool's."""
    sweep_dir, launcher = str(hydra_cfg.sweep.dir), OmegaConf.to_container(hydra_cfg.launcher)
    if not runs_in_a_pool(launcher):
        return _execute_in_slot(cfg, output_dir, job, overrides, sweep_dir, launcher, pool)
    t0 = time.perf_counter()
    status, how = job_process.JOB_PROCESS.run(_execute_in_slot, cfg, output_dir, job, overrides, sweep_dir, launcher)
    written = _result_of(output_dir, job)
    if written is None:
        message = (f"the job's process {how} before it wrote its result (a signal, the OOM killer, or an "
                   f"implementation that ended it); its ranks ended with it")
        failed = RunResult.not_launched(config_case(cfg), "error", message, phase="launcher",
                                        wall_s=time.perf_counter() - t0)
        written = write_result_and_page(output_dir, failed.to_json(), job)
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
                     launcher: dict, pool: rank_group.GroupPool | None = None) -> int:
    """A sweep's job: in a job slot of its own while the launcher runs several jobs at once on
    this node (`launcher.config.job_slot`), else with the whole node; `pool`: the warm rank
    groups of the process that runs it (the launcher's, a pool worker's job process)."""
    cpus = devices.cpu_affinity()
    planned = (sweep_summary.read_record(sweep_dir) or {}).get("jobs")
    planned_n = len(planned) if planned is not None else None
    prefix = f"[{job['num'] + 1}/{planned_n or '?'}] "
    if cpus is None or slot_count(launcher, planned_n, len(cpus), None) == 1:
        return execute(cfg, output_dir, job, overrides, prefix=prefix, pool=pool)
    try:
        device_env, node_devices = devices.node_devices()
    except Exception as e:  # a broken accelerator runtime: this job's ERROR, not a job without a result
        write_result_and_page(output_dir, RunResult.launcher_error(config_case(cfg), e, wall_s=0.0).to_json(), job)
        return EXIT_ERROR
    count = slot_count(launcher, planned_n, len(cpus), len(node_devices) if node_devices is not None else None)
    # Held until the job's result is written; released whatever happens, the job's death included.
    with slots.claim(os.path.abspath(sweep_dir), count, job["num"]) as index:
        return execute(cfg, output_dir, job, overrides, job_slot(index, count, cpus, node_devices, device_env),
                       prefix=prefix, pool=pool)


def finish(code, status: int | None, pool: rank_group.GroupPool | None) -> int:
    """The process's exit status once a run or a multirun started; the warm ranks its last
    jobs left in `pool` leave.

    `code`: how Hydra's application ended. None: normally, a single run whose `status` is what
    `execute` returned. Else the status it ended with: a multirun's, from the files its jobs
    wrote (`SweepSummary.on_multirun_end`, or for one that never reached its end the
    harness's sweeper, `launcher.report.sweep_summary.unfinished_status`), an interrupted
    run's 128 + the signal, or Hydra's own error exit.
    """
    if pool is not None:
        pool.close()
    CheckedRun.spec = None
    if code is not None:  # a multirun's (its summary's, `SweepSummary`), an interruption's, or Hydra's error
        return code if isinstance(code, int) else EXIT_ERROR
    return EXIT_PASS if status is None else status
