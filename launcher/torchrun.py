"""The worker under an external launcher: `torchrun --nproc_per_node 4 -m launcher.torchrun layer=swa tp=4`.

torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT) starts the processes; under `srun --ntasks-per-node=4` they come from the Slurm
step (`launcher.config.slurm`); each composes the same config from its command line, runs
the same preflight checks and the same per-rank worker. Rank 0 prints the report and writes
result.json; every rank exits with rank 0's verdict code (0 PASS, 1 FAIL), a rank other than
0 only once rank 0 has reported (torchrun stops every worker when one exits non-zero).

A rank that fails prints its traceback, records it in torchrun's error file (torchrun's summary
shows it), writes an error result.json and exits 2, as under `python -m launcher`. A rank
whose collective only broke because a peer failed writes its result only where no rank did
(the root cause's report stays) and exits a little later (`CASUALTY_EXIT_DELAY_S`). (torchrun
itself exits 1 whenever a worker fails.)
"""

from __future__ import annotations

if __name__ == "__main__":  # a worker process of its own: it imports with the collector paused
    from launcher.run import import_gc

import datetime
import os
import sys
import time
import traceback
from dataclasses import asdict

import torch.distributed as dist
from hydra import compose, initialize_config_module
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from launcher.config.slurm import node_keys, rank_env, slurm_step
from launcher.config.spec import RunSpec, config_case
from launcher.report.console import render, where_line
from launcher.report.result import EXIT_ERROR, exit_code
from launcher.report.run_page import write_result_and_page
from launcher.run import devices
from launcher.run.launch import RankFailure, failed_phase, is_casualty
from launcher.run.preflight import preflight
from launcher.run.run_result import RunResult
from launcher.run.worker import rank_main
from layers.contract.config import ConfigError


# torchrun stops every worker once it sees one exit, and its summary gives each the exit status
# it had then. A rank whose collective broke because a peer failed waits this long before it
# exits, so that the peer that failed ends with its own status, not stopped by torchrun while
# it still writes its report (its error file already says what happened here).
CASUALTY_EXIT_DELAY_S = 2.0


def output_dir_of(environ=os.environ) -> str:
    run_id = environ.get("TORCHELASTIC_RUN_ID") or environ.get("SLURM_JOB_ID") or "external"
    return os.path.abspath(environ.get("DSV4_OUTPUT_DIR", os.path.join("outputs", f"torchrun-{run_id}")))


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    errors = get_error_handler()
    errors.initialize()
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=argv)
    step = slurm_step(os.environ)
    if step is not None and "RANK" not in os.environ:
        # Under srun, one task per rank: the task's place in the step is its rank.
        try:
            keys = node_keys(cfg, step, task_is_rank=True)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR
        os.environ.update(rank_env(step, keys["master_addr"], keys["master_port"]))
    output_dir = output_dir_of()
    try:
        spec = preflight(cfg, output_dir, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        write_result_and_page(output_dir, RunResult.not_launched(config_case(cfg), "config-error", str(e), phase="config",
                                                           wall_s=time.perf_counter() - t0).to_json())
        return EXIT_ERROR
    rank = int(os.environ["RANK"])
    if rank == 0:  # an earlier run's result must not stand for this one (no rank can fail a phase
        # before rank 0 has joined the process group)
        try:
            os.remove(os.path.join(output_dir, "result.json"))
        except FileNotFoundError:
            pass
    try:
        rank_result = rank_main(spec)
    except Exception as e:
        errors.record_exception(e)
        print(traceback.format_exc(), file=sys.stderr)
        _report_failure(spec, rank, e, wall_s=time.perf_counter() - t0)
        if is_casualty(f"{type(e).__name__}: {e}"):
            time.sleep(CASUALTY_EXIT_DELAY_S)
        return EXIT_ERROR
    result = RunResult.launched(spec, machine=devices.machine_entry(spec.backend, spec.local_ranks), rank_result=rank_result,
                                error=None, log_dir=output_dir, wall_s=time.perf_counter() - t0).to_json()
    if rank_result.get("reporting"):  # the comparing rank reports for the run
        written = write_result_and_page(output_dir, result)
        print(render(result))
        print(where_line(output_dir, written))
        _report_done(spec, wait=False)
    elif exit_code(result) != 0:  # torchrun stops every worker once one exits non-zero
        _report_done(spec, wait=True)
    return exit_code(result)


def _report_done(spec: RunSpec, *, wait: bool) -> None:
    """Rank 0 says, through torchrun's store, that the run's report is written; a rank whose
    verdict is not PASS waits for that (up to timeout_s) before it exits, or torchrun would
    stop rank 0 before it reported. A store that cannot be reached only loses the wait."""
    key = f"dsv4-tp-harness/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/reported"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        if wait:
            store.wait([key])
        else:
            store.set(key, "1")
    except (KeyError, ValueError, RuntimeError):  # no store variables, or the store is gone or silent
        pass


def _report_failure(spec: RunSpec, rank: int, exc: BaseException, *, wall_s: float) -> None:
    """This rank's error as the run's result.json, unless it is a casualty and a rank already wrote one."""
    tb = "".join(traceback.format_exception(exc))
    message = f"{type(exc).__name__}: {exc}"
    phase = failed_phase(tb)
    failure = RankFailure(rank=rank, phase=phase[0] if phase else None, message=message, traceback=tb,
                          exitcode=EXIT_ERROR, log_dir=spec.output_dir)
    if is_casualty(message) and os.path.exists(os.path.join(spec.output_dir, "result.json")):
        return
    result = RunResult.launched(spec, machine=devices.machine_entry(spec.backend, spec.local_ranks), rank_result=None,
                                error=asdict(failure), log_dir=spec.output_dir, wall_s=wall_s).to_json()
    written = write_result_and_page(spec.output_dir, result)
    print(render(result))
    print(where_line(spec.output_dir, written))


if __name__ == "__main__":
    import_gc.resume()
    sys.exit(main(sys.argv[1:]))
