"""Start this node's ranks, run the job on them and collect the outcome.

On one node the launcher's own rank processes run it (`launcher.run.rank_group`, which may
keep them warm for a sweep's next job); across nodes torch's elastic agent does, as
`torch.distributed.run` would: RunSpec -> LaunchConfig -> elastic_launch(rank_main).
Each rank logs to `<output_dir>/logs/<run>/attempt_0/<rank>/{stdout,stderr}.log`; rank 0 is also
teed to the console. A failing rank becomes a `RankFailure` naming the root-cause rank, the
phase it failed in, its message, its traceback and its log folder.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher.config.rank_phases import RANK_PHASES
from launcher.config.spec import RunSpec
from launcher.run import devices, forkserver, rank_group, tee, watchdog
from launcher.run.worker import progress_path, rank_main

log = logging.getLogger("launcher.run.launch")

_PHASE_NOTE = re.compile(r"rank (\d+) failed in phase '(\w+)' at t=([0-9.]+)")
# A rank whose collective broke because a peer died is a casualty, not the root cause: gloo's
# and NCCL's wording, and HCCL's ("... times out", its timeout error code and the CANN error
# codes of a notify wait or socket that timed out).
_CASUALTY = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|timed out|times out|"
                       r"DistBackendError|NCCL communicator was aborted|heartbeat|HCCL_E_TIMEOUT|\bEI000[26]\b|"
                       r"the golden failed on rank",
                       re.IGNORECASE)


def failed_phase(traceback_text: str) -> tuple[str, float] | None:
    """The phase a rank's exception left it in, and when (the note `RankPhaseTimer` adds)."""
    m = _PHASE_NOTE.search(traceback_text)
    return (m.group(2), float(m.group(3))) if m else None


def is_casualty(message: str) -> bool:
    """Whether an error says the rank's collective broke because a peer failed or vanished."""
    return bool(_CASUALTY.search(message))


@dataclass
class RankFailure:
    rank: int | None  # None: no rank is to blame (the launcher was interrupted)
    phase: str | None
    message: str
    traceback: str
    exitcode: int
    log_dir: str | None
    other_ranks: list[int] = field(default_factory=list)


@dataclass
class LaunchOutcome:
    result: dict | None  # rank 0's return value when every rank succeeded
    failure: RankFailure | None
    log_dir: str
    interrupted: int | None = None  # the signal that stopped the launcher (every rank was stopped)

    @property
    def error(self) -> dict | None:
        """The root-cause failure as result.json's `error` entry; None when every rank succeeded."""
        return asdict(self.failure) if self.failure is not None else None


def _launch_config(spec: RunSpec, log_root: str, run_id: str) -> LaunchConfig:
    single = spec.nnodes == 1
    return LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.local_ranks,
        # Every node must derive the same run id: it names the rendezvous.
        run_id=run_id,
        role="rank",
        rdzv_backend="c10d",
        # Single node: port 0 on loopback, the store picks a free port, so concurrent runs never
        # collide. Multi-node: node 0 hosts the store where the user says.
        rdzv_endpoint=f"{spec.master_addr}:{spec.master_port}",
        rdzv_configs={"is_host": spec.node_rank == 0, "timeout": int(spec.timeout_s), "join_timeout": int(spec.timeout_s),
                      # how long a node tries to reach node 0's store (elastic's default: 60 s)
                      **({"read_timeout": int(spec.timeout_s)} if spec.node_rank != 0 else {})},
        local_addr="127.0.0.1" if single else devices.local_address_towards(spec.master_addr),
        max_restarts=0,
        monitor_interval=0.05,
        start_method=spec.start_method,
        # torch's own tee copies every line: rank 0's logs reach the console only under -v (launcher.run.tee).
        logs_specs=DefaultLogsSpecs(log_dir=log_root, redirects=Std.ALL, tee={0: Std.ALL} if tee.log_records_shown() else {}),
    )


def run_id_of(spec: RunSpec) -> str:
    """Unique per single-node run; for multi-node, the same on every node (from the shared config)."""
    c = spec.case
    if spec.nnodes == 1:
        return f"{c.layer}-{c.group_size}r-{uuid.uuid4().hex[:8]}"
    return f"{c.layer}-{c.group_size}r-{spec.master_addr.replace('.', '-')}-{spec.master_port}"


def _rank_log_dir(log_root: str, run_id: str, local_rank: int) -> str | None:
    hits = glob.glob(os.path.join(log_root, f"{run_id}*", "attempt_*", str(local_rank)))
    return sorted(hits)[-1] if hits else None


def _stderr_tail(log_dir: str | None, lines: int = 30) -> str:
    """The end of a rank's stderr; for a deadline's stack dump, the dump of the main thread
    (innermost frame first), which is where the rank was stuck."""
    try:
        with open(os.path.join(log_dir, "stderr.log"), errors="replace") as f:
            text = f.read()
    except (OSError, TypeError):
        return ""
    marker = text.rfind("Timeout (")  # faulthandler.dump_traceback_later's header
    if marker >= 0:
        return DEADLINE_NOTE + "\n" + "\n".join(text[marker:].splitlines()[:lines])
    # The rank's INFO records (its phases starting and ending) are no traceback: the failure's
    # phase names where it stopped, the log file holds them.
    return "\n".join([ln for ln in text.splitlines() if not tee.quiet_record(ln)][-lines:])


DEADLINE_NOTE = "the rank outlived its deadline (2 x timeout_s) and dumped its stacks:"


# How much a failure says about the root cause, most first: the rank's own error, a rank the
# launcher's watchdog killed (frozen, or past its deadline), a casualty of a peer's failure.
OWN, KILLED_BY_WATCHDOG, CASUALTY = 0, 1, 2


def _describe(rank: int, f, log_root: str, run_id: str, silent: dict, killed: dict) -> tuple[tuple, RankFailure]:
    log_dir = _rank_log_dir(log_root, run_id, f.local_rank)
    msg, tb = f.message, ""
    if isinstance(msg, dict):
        tb = msg.get("extraInfo", {}).get("py_callstack", "")
        msg = msg.get("message", "<no message>")
        phase, t = failed_phase(tb) or (None, float(f.timestamp))
        kind = CASUALTY if is_casualty(str(msg)) else OWN
    else:
        # No Python error report: the process exited on its own (os._exit, a deadline's stack
        # dump) or was killed; its progress events say in which phase, its stderr says the rest.
        phase, t = silent.get(rank, (None, float(f.timestamp)))
        where = f" in phase '{phase}'" if phase else ""
        tb = _stderr_tail(log_dir)
        if rank in killed:
            msg, kind = killed[rank], KILLED_BY_WATCHDOG
        else:
            why = "it outlived its deadline" if tb.startswith(DEADLINE_NOTE) else "os._exit, a crash or a signal"
            msg = f"rank {rank} exited with status {f.exitcode}{where} without a Python error report ({why})"
            kind = CASUALTY if f.exitcode in (-15, -9) and rank not in silent else OWN  # stopped by the agent
    failure = RankFailure(rank=rank, phase=phase, message=str(msg), traceback=tb, exitcode=f.exitcode, log_dir=log_dir)
    # Root cause first: by kind; among casualties, the one left behind in the earliest phase
    # (its peers had moved on); then the earliest (sub-second) failure time.
    return (kind, _phase_order(phase) if kind == CASUALTY else 0, t, rank), failure


def _phase_order(phase: str | None) -> int:
    return RANK_PHASES.index(phase) if phase in RANK_PHASES else len(RANK_PHASES)


def _recorded_failures(reported: list[ProcessFailure], log_root: str, run_id: str, nproc: int, rank_base: int,
                       killed: dict) -> dict:
    """The failures the ranks' monitor reported, every rank the watchdog killed, and every rank
    that left an error file before it was stopped."""
    # Key by our global rank (node-major, see worker.rank_main), not the agent's numbering.
    failures = {rank_base + f.local_rank: f for f in reported}
    for rank in killed:  # the agent reports only the first failure it saw
        failures.setdefault(rank, ProcessFailure(local_rank=rank - rank_base, pid=-1, exitcode=-signal.SIGKILL,
                                                 error_file=""))
    for local_rank in range(nproc):
        rank = rank_base + local_rank
        log_dir = _rank_log_dir(log_root, run_id, local_rank)
        error_file = os.path.join(log_dir, "error.json") if log_dir else ""
        if rank not in failures and os.path.isfile(error_file):
            failure = _read_error_file(local_rank, error_file)
            if failure is not None:
                failures[rank] = failure
    return failures


def _read_error_file(local_rank: int, error_file: str, tries: int = 20) -> ProcessFailure | None:
    """A stopped rank may still be writing its error file: retry briefly, then do without it."""
    for _ in range(tries):
        try:
            return ProcessFailure(local_rank=local_rank, pid=-1, exitcode=1, error_file=error_file)
        except ValueError:  # half-written JSON
            time.sleep(0.05)
    return None


def _unfinished_phases(output_dir: str, ranks) -> dict[int, tuple[str, float]]:
    """Ranks whose last progress event is the start of a phase: they hung or died in it."""
    open_phase = {}
    for rank in ranks:
        try:
            with open(progress_path(output_dir, rank)) as f:
                events = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            continue
        if events and events[-1]["event"] == "start":
            open_phase[rank] = (events[-1]["phase"], events[-1]["t"])
    return open_phase


def _failure(reported: list[ProcessFailure], spec: RunSpec, log_root: str, run_id: str, rank_base: int = 0,
             killed: dict | None = None) -> RankFailure:
    """The root-cause failure; `reported`: the failures the ranks' monitor saw (the elastic
    agent's, or the rank group's); `killed`: the ranks the launcher's watchdog killed, and why."""
    nproc = spec.local_ranks
    killed = killed or {}
    failures = _recorded_failures(reported, log_root, run_id, nproc, rank_base, killed)
    silent = _unfinished_phases(spec.output_dir, range(rank_base, rank_base + nproc))
    ranked = sorted(_describe(r, f, log_root, run_id, silent, killed) for r, f in failures.items())
    casualties_only = all(key[0] == CASUALTY for key, _ in ranked)
    if casualties_only and silent:
        # Every error report blames a peer: the root cause is a rank that stopped in a phase
        # without one (it hung, or exited without a Python error).
        rank = min(silent, key=lambda r: (silent[r][1], r))
        phase = silent[rank][0]
        log_dir = _rank_log_dir(log_root, run_id, rank - rank_base)
        root = RankFailure(
            rank=rank, phase=phase, exitcode=failures[rank].exitcode if rank in failures else -1,
            message=f"rank {rank} stopped in phase '{phase}' without an error report (it hung, exited or was killed); its peers lost it",
            traceback=_stderr_tail(log_dir), log_dir=log_dir,
        )
        root.other_ranks = sorted(f.rank for _, f in ranked if f.rank != rank)
        return root
    root = ranked[0][1]
    root.other_ranks = sorted(f.rank for _, f in ranked[1:])
    ahead = [f for _, f in ranked[1:] if _phase_order(f.phase) > _phase_order(root.phase)]
    if casualties_only and root.phase and ahead:
        # Every rank timed out, this one in an earlier phase than its peers: it waited in a
        # collective they never entered (an extra one of its own), or they skipped one.
        phases = sorted({f.phase for f in ahead if f.phase}, key=_phase_order)
        root.message = (f"rank {root.rank} was left behind in phase '{root.phase}' while ranks "
                        f"{sorted(f.rank for f in ahead)} had moved on to {', '.join(repr(s) for s in phases) or 'the end'}: "
                        f"it entered a collective they never entered (or they skipped one); it saw: {root.message}")
        return root
    if casualties_only and spec.nnodes > 1:
        # This node's ranks only lost a peer: the cause is on another node.
        per = spec.local_ranks
        others = ", ".join(f"node {n} (ranks {n * per}-{n * per + per - 1})" for n in range(spec.nnodes) if n != spec.node_rank)
        root.message = (f"a rank on another node failed or stopped during phase '{root.phase}': {others}; "
                        f"see that node's report. This node's ranks saw: {root.message}")
    return root


@contextmanager
def _private_tempdir():
    """The launch's temp files in a folder of its own, removed once the outcome is read: torch's
    `start_processes` names an error file per rank in the temp folder
    (`pytorch-errorfile-*.pickle`), which a rank that raises writes and nothing ever removes.
    (`tempfile.tempdir` is the standard library's documented switch for that folder.)"""
    folder = tempfile.mkdtemp(prefix="dsv4-launch-")
    previous, tempfile.tempdir = tempfile.tempdir, folder
    try:
        yield
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


def launch(spec: RunSpec, pool: rank_group.GroupPool | None = None) -> LaunchOutcome:
    log_root = os.path.join(spec.output_dir, "logs")
    os.makedirs(log_root, exist_ok=True)
    run_id = run_id_of(spec)
    if spec.start_method == "forkserver":
        forkserver.start()  # a no-op when `python -m launcher` already started it
    else:
        forkserver.use_standard_start_method(spec.start_method)
        forkserver.set_cpu_env()  # inherited by every rank
    if spec.nnodes == 1:
        return _launch_here(spec, log_root, run_id, pool)
    return _launch_elastic(spec, log_root, run_id)


def _launch_here(spec: RunSpec, log_root: str, run_id: str, pool: rank_group.GroupPool | None) -> LaunchOutcome:
    """Every rank on this node, in the launcher's own rank processes (`rank_group`): warm ones
    a job of the same shape left, or new ones. The group is kept only when every rank
    finished and the run did not fail (and not by a parallel sweep's job on accelerators), in
    `pool`, the warm groups of the process's runs (None: the ranks leave with the run)."""
    group = pool.take(spec) if pool is not None else rank_group.RankGroup(spec)
    try:
        with watchdog.RankWatchdog(spec.output_dir, range(spec.world), spec.deadline_s) as dog:
            results, failures = group.run(spec, run_id, log_root, on_rank_done=dog.finished)
    except rank_group.Interrupted as e:  # every rank was stopped
        return _interrupted(e.signum, log_root)
    if failures is not None:  # the group was stopped
        failure = _failure(failures, spec, log_root, run_id, 0, dog.killed)
        return LaunchOutcome(result=None, failure=failure, log_dir=log_root)
    result = _comparing_rank_result(results.values())
    # A job slot's devices go to another job process next: its ranks may not keep them.
    shares_devices = spec.slot is not None and rank_group.holds_devices(spec)
    if group.harness_changed:  # by the implementation after its job's last check: this verdict stands
        log.warning("rank processes ended after this job: %s", "; ".join(
            f"rank {r}: {', '.join(c)}" for r, c in sorted(group.harness_changed.items())))
    if (pool is not None and spec.warm_ranks and result.get("passed") is not False and not shares_devices
            and not group.harness_changed):
        pool.keep(group)
    else:
        group.close()
    result["rank_processes"] = {"jobs_run": group.jobs_run, "warm": group.jobs_run > 1}
    return LaunchOutcome(result=result, failure=None, log_dir=log_root)


def _interrupted(signum: int, log_root: str) -> LaunchOutcome:
    name = signal.Signals(signum).name
    failure = RankFailure(
        rank=None, phase="interrupted", message=f"interrupted by {name}: every rank was stopped",
        traceback="", exitcode=128 + int(signum), log_dir=log_root,
    )
    return LaunchOutcome(result=None, failure=failure, log_dir=log_root, interrupted=int(signum))


def _comparing_rank_result(results) -> dict:
    """The comparing rank's (global rank 0) full result; every other rank returns the verdict
    rank 0 broadcast, which is all a node without rank 0 reports."""
    results = [r for r in results if r is not None]
    full = [r for r in results if r.get("reporting")]
    return (full or results)[0]


def _launch_elastic(spec: RunSpec, log_root: str, run_id: str) -> LaunchOutcome:
    """This node's ranks under torch's elastic agent, which meets the other nodes' agents at
    node 0's rendezvous."""
    # The agent logs every worker failure itself; our report names the root cause instead.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process ..."
    logging.getLogger("torchelastic-events-null").setLevel(logging.WARNING)  # per-worker status events
    ranks = range(spec.rank_base, spec.rank_base + spec.local_ranks)
    try:
        with _private_tempdir(), watchdog.RankWatchdog(spec.output_dir, ranks, spec.deadline_s) as dog:
            results = elastic_launch(_launch_config(spec, log_root, run_id), rank_main)(spec)
    except ChildFailedError as e:
        failure = _failure(list(e.failures.values()), spec, log_root, run_id, spec.rank_base, dog.killed)
        return LaunchOutcome(result=None, failure=failure, log_dir=log_root)
    except RendezvousTimeoutError as e:
        failure = RankFailure(
            rank=None, phase="rendezvous", traceback="", exitcode=-1, log_dir=log_root,
            message=(f"rendezvous at {spec.master_addr}:{spec.master_port} timed out after {spec.timeout_s:.0f} s: "
                     f"not all {spec.nnodes} nodes joined" + (f" ({' '.join(str(e).split())})" if str(e).strip() else "")),
        )
        return LaunchOutcome(result=None, failure=failure, log_dir=log_root)
    except (RendezvousConnectionError, RendezvousClosedError) as e:
        # A node other than 0 reached node 0's store in its preflight: node 0 then closed the
        # rendezvous (it gave up waiting for a node), its store was lost (it stopped) or stopped
        # answering, before every node joined.
        cause = " ".join(str(e.__cause__ or e).split())[:300] or "the rendezvous was closed"
        failure = RankFailure(
            rank=None, phase="rendezvous", traceback="", exitcode=-1, log_dir=log_root,
            message=(f"node {spec.node_rank} reached node 0's rendezvous store at {spec.master_addr}:{spec.master_port}, "
                     f"which then failed before all {spec.nnodes} nodes joined ({cause}): node 0 gives up when not "
                     f"every node joins within its timeout_s, or it stopped; start every node within timeout_s "
                     f"of node 0"),
        )
        return LaunchOutcome(result=None, failure=failure, log_dir=log_root)
    except SignalException as e:  # Ctrl-C / SIGTERM: the agent has already stopped every rank
        return _interrupted(int(e.sigval), log_root)
    return LaunchOutcome(result=_comparing_rank_result(results.values()), failure=None, log_dir=log_root)
