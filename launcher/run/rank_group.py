"""This node's ranks as processes the launcher starts itself and may keep for the next job.

A single-node run needs no rendezvous between agents: the launcher hosts the world's store,
starts one process per rank (`launcher.run.rank_server.serve`, from the forkserver) and sends
each the job. A sweep's jobs of the same world size, threads, backend, timeout and job slot
(`group_key`) then run on the same warm processes: no fork, no process-group set-up, no
teardown, no re-imports between jobs. A group is kept only after a job in which every rank
finished and the run did not fail (`launch.launch` decides), and in which nothing replaced a
function the golden runs (`harness_changed`, told by each rank after its job); any other job's
group is stopped and the next job starts fresh processes.

Each job writes what a fresh process would: per-rank logs in
`<output_dir>/logs/<run_id>/attempt_0/<rank>/`, rank 0's teed to the console with the elastic
agent's `[rank0]:` prefix, and the elastic agent's `error.json` for a rank that raised; a rank
that dies is reported as a `ProcessFailure`, the form the elastic agent reports it in, so one
failure analysis (`launcher.run.launch`) serves both.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack, contextmanager

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from launcher.config.spec import RunSpec
from launcher.run import devices, rank_server
from launcher.run.tee import Tee

KEEP_GROUPS = 4  # warm groups kept at once (least recently used first out)
_POLL_S = 0.05
_STOP_GRACE_S = 2.0  # SIGTERM first, then SIGKILL
# After a rank's death, how long the ranks still in the job may take to end on their own. A
# peer whose collective broke records its own error before it exits; stopped while it writes,
# its report is lost, and with it, where that peer was the root cause, the run's blame.
_PEERS_GRACE_S = 2.0
# How often the console's tee of rank 0 looks for new lines (its end at a job's end does not wait).
_TEE_POLL_S = 0.01


class Interrupted(Exception):
    """The launcher received SIGINT or SIGTERM while a job ran: every rank was stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def group_key(spec: RunSpec) -> tuple:
    """What a rank process is started or set up with: jobs that agree on it can share one."""
    return (spec.world, spec.start_method, spec.backend, spec.timeout_s, spec.threads(), spec.slot)


def holds_devices(spec: RunSpec) -> bool:
    """Whether the ranks hold accelerators (a warm rank keeps its device context)."""
    return devices.resolve_backend(spec.backend) != "gloo"


def rank_log_dir(log_root: str, run_id: str, local_rank: int) -> str:
    return os.path.join(log_root, run_id, "attempt_0", str(local_rank))


class RankGroup:
    """`spec.world` rank processes joined in one world, taking one job at a time."""

    def __init__(self, spec: RunSpec):
        self.key = group_key(spec)
        self.world = spec.world
        self.jobs_run = 0
        # What a job left replaced of the functions the golden runs, by rank: such ranks serve no later job.
        self.harness_changed: dict[int, list[str]] = {}
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
        context = multiprocessing.get_context(spec.start_method)
        self.conns, self.procs = [], []
        for rank in range(self.world):
            ours, theirs = context.Pipe()
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                   "ROLE_NAME": "rank", "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.world),
                   "ROLE_WORLD_SIZE": str(self.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self._store.port),
                   # the ranks join the launcher's store instead of hosting one
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "0"}
            proc = context.Process(target=rank_server.serve, args=(rank, env, theirs), name=f"rank{rank}")
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, spec: RunSpec, run_id: str, log_root: str, on_rank_done=None):
        """Run `spec` on every rank: `(results, failures)`, the ranks' return values by local
        rank when all finished, else the ranks that had died when the first death was seen,
        as `ProcessFailure`s (every other rank is stopped then). `on_rank_done(rank)`: told
        as each rank returns. Raises `Interrupted` on SIGINT or SIGTERM, after stopping every
        rank."""
        self.jobs_run += 1
        logs = [rank_log_dir(log_root, run_id, r) for r in range(self.world)]
        for d in logs:
            os.makedirs(d, exist_ok=True)
        with ExitStack() as stack:
            stack.enter_context(_interrupts_raise())
            stack.enter_context(_tee_rank0(logs[0]))
            try:
                for conn, log_dir in zip(self.conns, logs):
                    try:
                        conn.send((spec, log_dir))
                    except OSError:  # the rank has just died: `_wait` reports how
                        pass
                return self._wait(logs, on_rank_done)
            except Interrupted:
                self.stop()
                raise

    def _wait(self, logs: list[str], on_rank_done):
        results: dict[int, object] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while len(results) < self.world:
            ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout=_POLL_S)
            for item in ready:
                if item in waiting:
                    rank = waiting[item]
                    del waiting[item]
                    try:
                        results[rank], changed = item.recv()
                    except (EOFError, OSError):  # it died: its sentinel says how
                        continue
                    if changed:
                        self.harness_changed[rank] = changed
                    del sentinels[self.procs[rank].sentinel]  # done with this job, whatever it does next
                    if on_rank_done is not None:
                        on_rank_done(rank)
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:  # every rank that ended by itself so far or within the grace; the others are stopped
                dead += _ending_on_their_own({s: r for s, r in sentinels.items() if r not in dead})
                failures = []
                for rank in dead:
                    proc = self.procs[rank]
                    proc.join()
                    failures.append(ProcessFailure(local_rank=rank, pid=proc.pid, exitcode=proc.exitcode,
                                                   error_file=os.path.join(logs[rank], "error.json")))
                self.stop()
                return None, failures
        return results, None

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def stop(self) -> None:
        """End every rank now: SIGTERM, then SIGKILL for any still there after a grace."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._close_ends()

    def close(self) -> None:
        """Let idle ranks exit; any that do not within the grace are killed."""
        self.ask_to_leave()
        self.wait_to_leave()

    def ask_to_leave(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass

    def wait_to_leave(self) -> None:
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.stop()

    def _close_ends(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []


def _ending_on_their_own(running: dict) -> list[int]:
    """The ranks of `running` (sentinel -> rank) that end within `_PEERS_GRACE_S`; returns as
    soon as all have ended."""
    ended = []
    deadline = time.monotonic() + _PEERS_GRACE_S
    while running and (left := deadline - time.monotonic()) > 0:
        for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
            ended.append(running.pop(sentinel))
    return ended


@contextmanager
def _interrupts_raise():
    """SIGINT and SIGTERM raise `Interrupted` in the launcher while a job runs (main thread
    only, where handlers live), so that it stops its ranks and reports the run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)  # None: not set from Python


def _tee_rank0(log_dir: str) -> Tee:
    """Rank 0's stdout and stderr on the console too, line by line as the elastic agent tees them."""
    return Tee([(os.path.join(log_dir, "stdout.log"), sys.stdout), (os.path.join(log_dir, "stderr.log"), sys.stderr)],
               "[rank0]:", _TEE_POLL_S)


class GroupPool:
    """Warm groups by key, the least recently used stopped beyond `KEEP_GROUPS`. On
    accelerators a node holds one group at a time: no two processes share a device."""

    def __init__(self):
        self._groups: OrderedDict[tuple, RankGroup] = OrderedDict()
        # Closed before multiprocessing joins this process's children at its exit (they would
        # wait for a next job forever): in the launcher's own process and in a job process of a
        # parallel Hydra launcher, which multiprocessing ends without running atexit handlers.
        multiprocessing.util.Finalize(self, self.close, exitpriority=100)

    def take(self, spec: RunSpec) -> RankGroup:
        """A warm group for `spec` (out of the pool while it runs), or new processes."""
        group = self._groups.pop(group_key(spec), None)
        if group is not None and not group.alive():  # a rank ended while idle (killed, OOM)
            group.stop()
            group = None
        if holds_devices(spec):
            self.close()
        return group if group is not None else RankGroup(spec)

    def keep(self, group: RankGroup) -> None:
        self._groups[group.key] = group
        while len(self._groups) > KEEP_GROUPS:
            self._groups.popitem(last=False)[1].close()

    def close(self) -> None:
        """Every group leaves at once: asked one after another and waited for one after
        another, the groups of a sweep over several world sizes would add up their exits."""
        groups = list(self._groups.values())
        self._groups.clear()
        for group in groups:
            group.ask_to_leave()
        for group in groups:
            group.wait_to_leave()

