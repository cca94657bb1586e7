"""Sweep housekeeping: list a sweep's jobs without running them; rerun an earlier sweep's jobs
that did not pass.

    python -m launcher.sweep list +sweep=smoke                 # the jobs `-m +sweep=smoke` would run
    python -m launcher.sweep list layer=swa,csa tp=1,2,4 model=tiny
    python -m launcher.sweep rerun multirun/2026-12-03/10-00-00 [--list] [--into DIR] [OVERRIDES...]

`list` expands the multirun as Hydra's basic sweeper does (a sweep file's params, then the
command line) and checks each job's keys and case as a run first checks them (torch-free),
starting nothing; exit 2 when a job would be refused. `rerun` runs the jobs whose verdict was FAIL, ERROR or SKIP one
after another (`python -m launcher JOB'S OVERRIDES OVERRIDES...`) into a sweep folder of its
own (`DIR`, default `<sweep dir>/rerun-<date>-<time>`), which gets its summary.json, junit.xml
and table as any sweep does; exit status the worst rerun job's. `--list` names them only.
`DIR` must be new or empty: a rerun never writes over a sweep's summary or a job's result (the
original sweep's, or another rerun's), and two reruns never share a folder.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf.errors import OmegaConfBaseException

from layers.contract.config import ConfigError

from launcher.config.output_dirs import fresh_dir
from launcher.config.schema import refused_overrides
from launcher.config.spec import check_config
from launcher.config.sweep_jobs import expand_jobs
from launcher.report.console import case_label, table_lines
from launcher.report.result import EXIT_ERROR, EXIT_PASS, write_result
from launcher.report.sweep_summary import SWEEP_FILE, collect_rows, job_entry, write_summary
from launcher.store.snapshot_layer import with_snapshot_layer

PASSED = ("PASS", "UNCHECKED")


def _is_hydra(override: str) -> bool:
    return override.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))


def _compose(overrides: list[str]):
    with initialize_config_module(config_module="configs", version_base=None):
        return compose(config_name="config", overrides=overrides)


def planned(args: list[str]) -> list[list[str]]:
    """The jobs `python -m launcher -m ARGS` runs, each as its task overrides."""
    args = with_snapshot_layer(args)
    refusal = refused_overrides(args)
    if refusal is not None:
        raise ConfigError(refusal)
    task = [a for a in args if not _is_hydra(a)]
    with initialize_config_module(config_module="configs", version_base=None):
        # Hydra's config loader lists a group's options for a `glob(...)` sweep.
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides(task)
        # The sweep file's params come with the config: compose it with each swept key's first value.
        first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else a
                 for o, a in zip(parsed, task)]
        cfg = compose(config_name="config", overrides=first + [a for a in args if _is_hydra(a)],
                      return_hydra_config=True)
        return expand_jobs(cfg.hydra.sweeper.get("params") or {}, task, parser)


def _check(overrides: list[str]) -> tuple[str, str]:
    """A job's case as its config and the case's own rules read it (torch-free:
    `launcher.config.spec.check_config`), or why they refuse it; what the layer's fixtures,
    the tolerances, the implementation and the machine refuse is the job's run's to say. A
    replay's job is read with its snapshot by the preflight, which imports torch: here, for it
    alone."""
    try:
        cfg = _compose(overrides)
        spec = check_config(cfg)
        if spec is None:
            from launcher.run.preflight import preflight

            spec = preflight(cfg, output_dir=os.devnull)
    except (ConfigError, OmegaConfBaseException, Exception) as e:  # Hydra's refusals are plain exceptions
        return "refused", " ".join(str(e).split())
    c = spec.case
    dp = f" dp={spec.dp}" if spec.dp > 1 else ""
    return "ok", f"{case_label(c.describe(), c.scope, c.model.name)}{dp}"


def list_jobs(args: list[str]) -> int:
    jobs = planned(args)
    checks = [_check(overrides) for overrides in jobs]
    cells = [["job", "check", "case", "overrides"]]
    cells += [[str(num), status, text if status == "ok" else "-", " ".join(overrides)]
              for num, (overrides, (status, text)) in enumerate(zip(jobs, checks))]
    print("\n".join(table_lines(cells)))
    refused = [(num, text) for num, (status, text) in enumerate(checks) if status == "refused"]
    for num, text in refused:
        print(f"job {num} refused: {text}")
    print(f"sweep: {len(jobs)} jobs, {len(refused)} would be refused (keys and case rules checked; each run also "
          f"checks its layer's fixtures, the tolerances, impl and the devices)")
    return EXIT_ERROR if refused else EXIT_PASS


def _with_extra(overrides: list[str], extra: list[str]) -> list[str]:
    """A job's task overrides with `extra` added; a key given in both takes extra's value."""
    parser = OverridesParser.create()
    replaced = {o.get_key_element() for o in parser.parse_overrides(extra)}
    kept = [a for a, o in zip(overrides, parser.parse_overrides(overrides))
            if not _is_hydra(a) and o.get_key_element() not in replaced]
    return kept + extra


def earlier_rows(sweep_dir: str) -> list[dict]:
    """The jobs of an earlier sweep and their verdicts: its summary.json, else its jobs' files."""
    try:
        with open(os.path.join(sweep_dir, "summary.json")) as f:
            return json.load(f)["jobs"]
    except (OSError, ValueError, KeyError):
        return collect_rows(sweep_dir)


def rerun(sweep_dir: str, into: str | None, extra: list[str], only_list: bool) -> int:
    if not os.path.isdir(sweep_dir) or not any(
            os.path.isfile(os.path.join(sweep_dir, f)) for f in ("summary.json", SWEEP_FILE)):
        print(f"error: {sweep_dir} is not a sweep folder (it has no summary.json or {SWEEP_FILE})", file=sys.stderr)
        return EXIT_ERROR
    todo = [r for r in earlier_rows(sweep_dir) if r["verdict"] not in PASSED]
    for r in todo:
        print(f"job {r['job']} {r['verdict']}: {' '.join(r['overrides'])}")
    if only_list or not todo:
        print(f"rerun: {len(todo)} jobs of {sweep_dir} did not pass")
        return EXIT_PASS
    jobs = [_with_extra(r["overrides"], extra) for r in todo]
    # Each rerun job keeps its number in the earlier sweep: its folder, its row and its page say job 3
    # where the earlier sweep did.
    numbers = [r["job"] for r in todo]
    record = {"id": os.urandom(16).hex(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "jobs": jobs,
              "numbers": numbers, "rerun_of": {"sweep_dir": os.path.abspath(sweep_dir), "jobs": numbers}}
    into = _claim(into or fresh_dir(os.path.join(sweep_dir, time.strftime("rerun-%Y%m%d-%H%M%S"))), record)
    for i, (num, overrides) in enumerate(zip(numbers, jobs)):
        print(f"[{i + 1}/{len(jobs)}] rerun of job {num}: {' '.join(overrides)}", file=sys.stderr)
        job_dir = os.path.join(into, str(num))
        try:
            code = subprocess.run([sys.executable, "-m", "launcher", *overrides, f"hydra.run.dir={job_dir}"]).returncode
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        _adopt(job_dir, job_entry(into, num, overrides))
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            write_summary(into, interrupted=True)
            return code
    return write_summary(into)


def _claim(into: str, record: dict) -> str:
    """Make `into` (new or empty) the rerun's sweep folder by creating its sweep.json, which no
    other process can create as well; ConfigError for a folder that holds anything."""
    into = os.path.abspath(into)
    try:
        entries = sorted(os.listdir(into)) if os.path.isdir(into) else []
        if entries:
            shown = ", ".join(entries[:5]) + (f", ... {len(entries) - 5} more" if len(entries) > 5 else "")
            raise ConfigError(f"--into {into} is not empty (it holds {shown}): a rerun writes into a new or empty "
                              f"folder, never over a sweep's summary or results")
        os.makedirs(into, exist_ok=True)
        with open(os.path.join(into, SWEEP_FILE), "x") as f:
            json.dump(record, f, indent=1)
    except FileExistsError as e:  # another rerun claimed it meanwhile, or `into` is a file
        raise ConfigError(f"--into {into}: {e.filename} exists; choose a new folder") from e
    except OSError as e:
        raise ConfigError(f"--into {into}: {e.filename} cannot be created ({e.strerror})") from e
    return into


def _adopt(job_dir: str, job: dict) -> None:
    """Make a run's result.json one job of the rerun's sweep (a run that left none stays an
    ERROR row of the summary)."""
    try:
        with open(os.path.join(job_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return
    write_result(job_dir, result, job)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.sweep", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the jobs a multirun with these overrides would run, checked, none run")
    ls.add_argument("overrides", nargs="*")
    rr = sub.add_parser("rerun", help="rerun the jobs of an earlier sweep that did not pass")
    rr.add_argument("sweep_dir")
    rr.add_argument("overrides", nargs="*", help="added to every rerun job's overrides")
    rr.add_argument("--into", help="the rerun's sweep folder (default: <sweep dir>/rerun-<date>-<time>)")
    rr.add_argument("--list", action="store_true", help="name the jobs that did not pass, run nothing")
    args = p.parse_args(argv)
    try:
        if args.command == "list":
            return list_jobs(args.overrides)
        return rerun(args.sweep_dir, args.into, args.overrides, args.list)
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
