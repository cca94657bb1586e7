"""The per-rank entry point: build the rank's fixture slice, run the implementation, gather, judge.

Runs in every process the elastic agent starts (or under an external torchrun, which sets the
same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* environment). Stages, in order
(`launcher.config.rank_stages`):

    fixture -> golden -> [save] -> layer -> gather -> compare -> [bisect]

The golden of a rank's shard (the single-device layer on that rank's tensors with the full O
weights, spec validation.md §5.3) is computed on that rank, in parallel with the others, from
clones taken before the implementation is even imported (in the layer stage), with the same
thread count: the per-rank front of the layer is then bit-identical between golden and
implementation, and only the output half differs by fp32 summation order. Each of the layer's checks is judged whole on a rank of its
own (`launcher.run.judging`: every rank sends its shards of the check's tensors there), and
rank 0 collects the verdicts.
A rank's inputs and golden are read from the golden cache when its entries are whole
(`launcher.run.rank_data`). A golden that fails on any rank stops every rank before the
implementation runs. Nothing the golden or the judges run may have been replaced (a
monkey-patch, `launcher.run.golden_guard`): checked before the golden, after the implementation
is imported and built, and after each time it ran; a change is a contract error.
With `golden_data` the inputs and the reference come from a snapshot (each rank reads its own
slice); `recompute_golden` adds the computed golden as a second reference.
Rank 0 returns the run's result (a plain dict) to the launcher; the other ranks return the
verdict rank 0 broadcast.
Any exception carries a note naming the rank and stage, and the elastic error file keeps its
traceback for the launcher's failure report.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import functools
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from layers.contract.checks import PoolCheck
from layers.contract.context import RankContext
from layers.contract.tensors import Kind, tensor_sha256
from layers.distributed import wire

from launcher.config.faults import Fault
from launcher.config.rank_stages import RANK_STAGES
from launcher.config.spec import RunSpec
from launcher.config.verdict_words import fails_the_run
from launcher.run import bench, devices, faults, forkserver, golden_guard, judging, lifeline, nodes, watchdog
from launcher.run.groups import GroupLayout, by_group, tp_process_group
from launcher.run.rank_data import cached_golden, rank_inputs
from launcher.store import snapshot
from launcher.verify import bisect
from launcher.verify.base import initial_key
from launcher.verify.integrity import golden_nonfinite

log = logging.getLogger("launcher.run.worker")


class ImplContractError(RuntimeError):
    """The implementation under test returned something that breaks the layer's contract."""


_SIGINT_RECEIVED = threading.Event()


def note_sigint() -> None:
    """Note a real SIGINT before Python's handler turns it into KeyboardInterrupt (so that one
    the implementation raises itself can be told apart). Main thread only, where handlers live."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        return  # ignored or default: no signal becomes a KeyboardInterrupt

    def handler(signum, frame):
        _SIGINT_RECEIVED.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)


@contextmanager
def implementation_contract(rank: int):
    """The implementation's code returns its outputs or raises an error. A `sys.exit()` or a
    KeyboardInterrupt of its own would end this rank without an error report while its peers
    wait in the next collective, and a peer's timeout would be blamed: both are contract errors
    of this rank. (A KeyboardInterrupt from a real Ctrl-C passes on.)"""
    try:
        yield
    except SystemExit as e:
        raise ImplContractError(f"rank {rank}: the implementation called sys.exit({e.code!r}) "
                                f"instead of returning its outputs or raising an error") from e
    except KeyboardInterrupt as e:
        if _SIGINT_RECEIVED.is_set():
            raise
        raise ImplContractError(f"rank {rank}: the implementation raised KeyboardInterrupt itself (no Ctrl-C "
                                f"reached this rank) instead of returning its outputs or raising an error") from e


def check_harness_untouched(rank: int, when: str) -> None:
    """Refuse to go on where a function the golden or the judges run was replaced
    (`golden_guard`): a golden computed with it would be the implementation's math."""
    changed = golden_guard.changes()
    if changed:
        raise ImplContractError(
            f"rank {rank}: functions the golden and the judges run changed {when}: {'; '.join(changed)}. The "
            "implementation must call its own functions, not replace the harness's or torch's")


class GoldenNotFinite(RuntimeError):
    """The reference holds non-finite values where it must be finite: it cannot judge the run
    (a config whose math breaks down, or a damaged snapshot), so the run is an error, not a FAIL."""


def progress_path(output_dir: str, rank: int) -> str:
    """Where rank `rank` appends its stage events (JSON lines) for the launcher's progress display."""
    return os.path.join(output_dir, "progress", f"rank{rank}.jsonl")


class RankStageTimer:
    """The stages of this rank's run (`launcher.config.rank_stages`): times each (wall, and the
    CPU of every thread of this process: a stage whose wall far exceeds its CPU waited on a
    peer, a device or the disk), records its start and end as progress events, fires a
    configured fault at its start, and tags a failure with the rank and stage it happened in."""

    def __init__(self, rank: int, output_dir: str, fault: Fault | None = None):
        self.rank = rank
        self.fault = fault
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        path = progress_path(output_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._events = open(path, "a", buffering=1)

    def _event(self, name: str, event: str) -> None:
        self._events.write(json.dumps({"rank": self.rank, "stage": name, "event": event, "t": time.time()}) + "\n")

    @contextmanager
    def stage(self, name: str):
        assert name in RANK_STAGES, name
        t0, cpu0 = time.perf_counter(), time.process_time()
        log.info("stage %s ...", name)
        self._event(name, "start")
        try:
            faults.at_stage_start(self.fault, name, self.rank)
            yield
        except BaseException as e:
            self._event(name, "failed")
            e.add_note(f"rank {self.rank} failed in stage '{name}' at t={time.time():.6f}")
            raise
        self.seconds[name] = time.perf_counter() - t0
        self.cpu_seconds[name] = time.process_time() - cpu0
        self._event(name, "done")
        log.info("stage %s done (%.2fs)", name, self.seconds[name])


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True
    )


def check_outputs(outputs, expected_specs: dict, rank: int) -> None:
    """Refuse, on the rank that produced it, an output the gather and comparators cannot take."""
    if not isinstance(outputs, dict):
        raise ImplContractError(f"rank {rank}: impl returned {type(outputs).__name__}, expected a dict of tensors")
    missing = [n for n in expected_specs if n not in outputs]
    if missing:
        raise ImplContractError(f"rank {rank}: impl did not return {', '.join(missing)}")
    for name, spec in expected_specs.items():
        t = outputs[name]
        if not isinstance(t, torch.Tensor):
            raise ImplContractError(f"rank {rank}: impl output '{name}' is {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ImplContractError(
                f"rank {rank}: impl output '{name}' has shape {tuple(t.shape)} dtype {t.dtype}, "
                f"expected shape {spec.shape} dtype {spec.dtype}"
            )


def check_inputs_unchanged(tensors: dict[str, torch.Tensor], digests: dict[str, str], rank: int) -> None:
    """Refuse an implementation that changed a pure input in place (only in-outs may change):
    `digests` are the inputs' sha256 taken when the fixture was built."""
    changed = [n for n, digest in digests.items() if tensor_sha256(tensors[n]) != digest]
    if changed:
        raise ImplContractError(f"rank {rank}: impl changed its pure input(s) {', '.join(changed)} in place "
                                "(the contract lets only the in-out caches and states change)")


def check_reference_finite(spec: RunSpec, case, layer, source: str, reference: dict, mappings: dict,
                           rank: int, cached: bool = False) -> None:
    """Refuse a reference that is non-finite where it must be finite (`golden_nonfinite`):
    every comparison against it would blame the implementation for the reference's NaN.
    `cached`: the golden came from the golden cache, not computed in this run."""
    for check in layer.checks(case):
        n = golden_nonfinite(check, reference[check.output], mappings.get(getattr(check, "mapping", None)))
        if not n:
            continue
        if source == "snapshot":
            origin = f"the snapshot's {spec.golden_data}/out/{check.output}.pt"
        else:
            origin = f"the golden {'read from the golden cache' if cached else 'computed'} for {config_text(case)}"
        raise GoldenNotFinite(f"rank {rank}: {origin} holds {n} non-finite value(s) in {check.output} where it must "
                              "be finite: a reference error, not the implementation's")


def config_text(case) -> str:
    """The case as a reader would check it, with the model fields changed from the preset."""
    changed = case.model.overrides()
    if changed is None:
        model = f"model={case.model.name} (no preset: {case.model.fields()})"
    else:
        model = f"model={case.model.name}" + "".join(f" model.{k}={v}" for k, v in changed.items())
    d = case.describe()
    return " ".join([f"layer={d.pop('layer')}", model] + [f"{k}={v}" for k, v in d.items()])


def gather_to_rank0(tensors: dict[str, torch.Tensor], names, rank: int, tp: int, device) -> dict[str, torch.Tensor]:
    """Every rank's tensor of each name, stacked `[tp, ...]` on rank 0 (CPU), bit-exact."""
    gathered = {}
    for name in names:
        stacked = wire.gather(tensors[name].detach().to(device), rank, tp)
        if rank == 0:
            gathered[name] = stacked
    return gathered


def rank_main(spec: RunSpec):
    """A rank in a process of its own (the elastic agent's, or an external torchrun's): join
    the world, run the one job, leave."""
    lifeline.die_with_parent()  # a rank never outlives its parent, whatever kills the launcher
    lifeline.guard_process_group()  # nor what it started
    golden_guard.record()  # a spawned rank's own; a forked one inherited its parent's
    devices.enter_job_slot(spec.slot)  # before anything counts the cores or devices
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if spec.nnodes > 1:
        # The rendezvous orders nodes by address and pid, not by node_rank; we number the ranks
        # node-major ourselves so that rank 0, which compares, is on node 0 as the user said.
        os.environ["RANK"] = str(spec.rank_base + local_rank)
        if spec.backend in ("gloo", "auto") and "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = devices.interface_of(devices.local_address_towards(spec.master_addr))
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname  # the interface that reaches node 0
    begin_job(spec)
    note_sigint()
    device = join_world(spec, local_rank)
    nodes.check_nodes_agree(spec)  # each node (each task under srun) composed its own config
    result = run_job(spec, device)
    # Not in a `finally`: a failing rank must record its error before its sockets close, or a
    # peer that sees the closed connection could be reported first.
    dist.destroy_process_group()
    return result


def begin_job(spec: RunSpec) -> None:
    """A job's first acts on its rank: tell the launcher's watchdog who it is, log as this rank,
    and arm the job's deadline (a rank that outlives it, hung outside any collective, dumps
    every thread's stack into its stderr log and exits, so a run can never hang forever)."""
    rank = int(os.environ["RANK"])
    watchdog.write_pid_file(spec.output_dir, rank)
    _setup_logging(rank)
    faulthandler.dump_traceback_later(spec.deadline_s, exit=True)


def join_world(spec: RunSpec, local_rank: int) -> torch.device:
    """What a rank process sets up once, for every job it runs: threads, backend, device and
    the world's process group (from the RANK / WORLD_SIZE / MASTER_* environment)."""
    forkserver.set_cpu_env()  # under an external torchrun nothing set it before
    world = int(os.environ["WORLD_SIZE"])
    if world != spec.world:
        raise RuntimeError(f"WORLD_SIZE={world} but the config asks for {spec.world} ranks "
                           f"(dp={spec.dp} groups of {spec.case.group_size})")
    torch.set_num_threads(spec.threads())
    backend = devices.resolve_backend(spec.backend)
    os.environ.update(devices.collective_timeout_env(backend, spec.timeout_s, os.environ))
    device = devices.setup_device(backend, local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec.timeout_s))
    return device


def run_job(spec: RunSpec, device: torch.device):
    """One job on a rank that has joined the world (`begin_job` done): rank 0 returns the
    run's result, the others the verdict rank 0 broadcast."""
    layout = GroupLayout(spec.dp, spec.case.group_size, int(os.environ["RANK"]))
    group = tp_process_group(layout)
    result = _run(spec, layout, group, device)
    if group is not dist.group.WORLD:
        dist.destroy_process_group(group)  # a warm rank's world outlives the job's groups
    faulthandler.cancel_dump_traceback_later()
    return result


def node_ranks(spec: RunSpec) -> range:
    """The global ranks of this rank's node, from the launcher's environment (every launcher
    places a node's ranks one after another and sets LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    first = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", 0))
    size = os.environ.get("LOCAL_WORLD_SIZE")
    return range(first, first + (int(size) if size else spec.local_ranks))


class ReferenceFailed(RuntimeError):
    """A peer's golden (or its snapshot's reference) failed: this rank stops before the
    implementation runs."""


def stop_unless_every_reference_was_made(failure: Exception | None, rank: int, world: int, device) -> None:
    """A golden that fails stops the run before any rank runs the implementation (the reference
    runner's rule, validation.md §3 step 3): the ranks agree first. The failing rank raises its
    own error, every other rank a `ReferenceFailed` naming it."""
    failed = wire.all_gather(torch.tensor([failure is not None], dtype=torch.uint8, device=device), None, world)
    failed = failed.view(-1).tolist()
    if failure is not None:
        raise failure
    if any(failed):
        ranks = [r for r, f in enumerate(failed) if f]
        raise ReferenceFailed(f"rank {rank}: the golden failed on rank(s) {ranks}; no rank runs the implementation")


def _run(spec: RunSpec, layout: GroupLayout, group, device: torch.device):
    """One rank's run; `layout` places it in its TP group, `group` is that group's process
    group. The harness's gathers (a snapshot's to global rank 0, each compared tensor's to
    its judge) go over the world group."""
    case = spec.case.of_group(layout.group)
    rank, grank, world = layout.rank, layout.group_rank, layout.world
    layer = spec.layer
    timer = RankStageTimer(rank, spec.output_dir, spec.fault)
    specs = layer.tensor_specs(case)
    compared = layer.compared_names(case)
    in_names = [n for n, s in specs.items() if s.kind is not Kind.OUTPUT]
    mappings = sorted({c.mapping for c in layer.checks(case) if isinstance(c, PoolCheck)})
    inout = [n for n in compared if specs[n].kind is Kind.INOUT]
    pure = layer.names_of(case, Kind.INPUT)
    with timer.stage("fixture"):
        check_harness_untouched(rank, "before this job's golden (by an implementation imported before it: an "
                                      "earlier job's on this warm rank, or this one's by the preflight of this "
                                      "process or of the one it was forked from)")
        wo_full, inputs_cache = None, None
        if spec.golden_data:
            inputs = snapshot.load_rank(spec.golden_data, "in", in_names, grank, specs)
            input_digests = {n: tensor_sha256(inputs[n]) for n in pure}
        else:
            made = rank_inputs(spec, layer, case, grank, pure, stores_group=layout.leads_group_on(node_ranks(spec)))
            inputs, input_digests, wo_full, inputs_cache = made.tensors, made.sha256, made.wo_full, made.cache
            del made  # the tensors go with `inputs`, before the judges stack theirs
    # Every reference is made before the implementation is imported, from clones of the inputs:
    # nothing its module, constructor or call does can reach it.
    ctx = RankContext(case=case, rank=grank, device=device, group=group, global_rank=rank, group_index=layout.group)
    references, cache_status, context = {}, None, {}
    if spec.golden:
        failure = None
        try:
            with timer.stage("golden"):
                if spec.golden_data:
                    references["snapshot"] = snapshot.load_rank(spec.golden_data, "out", compared, grank, specs)
                if not spec.golden_data or spec.recompute_golden:
                    references["golden"], cache_status = cached_golden(spec, layer, ctx, inputs, wo_full)
                for source, reference in references.items():
                    check_reference_finite(spec, case, layer, source, reference, inputs, rank,
                                           cached=source == "golden" and cache_status == "hit")
                context = {n: inputs[n].clone() for n in mappings}
                context.update({initial_key(n): inputs[n].clone() for n in inout})
        except Exception as e:  # raised once every rank has heard of it
            failure = e
        stop_unless_every_reference_was_made(failure, rank, world, device)
    del wo_full
    if spec.save_data:
        with timer.stage("save"):
            stacked_in = gather_to_rank0(inputs, in_names, rank, world, device)
            stacked_out = gather_to_rank0(next(iter(references.values())), compared, rank, world, device)
            if rank == 0:
                for g, (ins, outs) in enumerate(zip(by_group(stacked_in, layout), by_group(stacked_out, layout))):
                    folder = spec.save_data if layout.dp == 1 else os.path.join(spec.save_data, f"group{g}")
                    group_case = spec.case.of_group(g)
                    snapshot.save(folder, group_case, specs, ins, outs, _starts(ins, group_case))
            del stacked_in, stacked_out
    with timer.stage("layer"):
        with implementation_contract(rank):
            impl = instantiate(spec.impl)
        check_harness_untouched(rank, "on import or construction of the implementation")
        tensors = {n: t.to(device) for n, t in inputs.items()}
        # The benchmark restores the in-out tensors to their values before the step.
        pristine = {n: t.clone() for n, t in tensors.items() if specs[n].kind is Kind.INOUT} if spec.bench else {}
        pure_tensors = {n: tensors[n] for n in pure}  # the implementation may rebind the dict's entries
        with implementation_contract(rank):
            outputs = impl(ctx, tensors)
        check_harness_untouched(rank, "while the implementation ran")
        # An output fault hits the layer's output (x_out, x_next), a focused scope's first in-out.
        faults.on_outputs(spec.fault, rank, outputs, (layer.names_of(case, Kind.OUTPUT) or compared)[0], case.seq)
        check_outputs(outputs, {n: specs[n] for n in compared}, rank)
        check_inputs_unchanged(pure_tensors, input_digests, rank)
        del pure_tensors
    with timer.stage("gather"):
        if not spec.bench:
            del tensors  # what the outputs do not alias is freed before the judges stack
        del inputs
        release_freed_memory()  # glibc keeps freed heap resident; the stacks are new mappings
        held = {}
        if references:
            assignments = judging.plan(layer.checks(case), context, specs, len(references), world)
            held = judging.send_to_judges(assignments, outputs, references, context, rank, world, device)
        del outputs, context
    bench_figures = None
    if spec.bench:
        with timer.stage("bench"):
            trace = os.path.join(spec.output_dir, "profile", f"rank{rank}.json") if spec.bench.profile else None
            if trace:
                os.makedirs(os.path.dirname(trace), exist_ok=True)
            times = bench.run_rounds(impl, ctx, tensors, pristine, spec.bench, trace)
            check_harness_untouched(rank, "while the benchmark ran the implementation")
            del tensors, pristine
            every = [None] * world if rank == 0 else None
            dist.gather_object(times, every, dst=0)
            if rank == 0:
                bench_figures = bench.summarize(spec.bench, every)
                if trace:
                    bench_figures["profiles"] = [os.path.join("profile", f"rank{r}.json") for r in range(world)]
    judged = []
    if spec.golden:
        with timer.stage("compare"):
            cases = [spec.case.of_group(g) for g in range(layout.dp)]
            judged = judging.judge(held, cases, layer.checks, spec.tolerances, layout, spec.integrity)
        del held
    stats = [None] * world if rank == 0 else None
    dist.gather_object({"seconds": timer.seconds, "cpu_seconds": timer.cpu_seconds, "golden_cache": cache_status,
                        "inputs_cache": inputs_cache, "peak_rss_mib": peak_rss_mib(), "cpus": devices.cpu_affinity(),
                        "judged": judged},
                       stats, dst=0)
    comparisons = integrity = None
    if rank == 0 and spec.golden:  # by group: {reference: verdicts}, {reference: checks}
        comparisons, integrity = judging.collect([s.pop("judged") for s in stats], layout.dp, list(references),
                                                 spec.integrity)
    # Every rank learns the verdict (None: nothing was compared), so every node exits with rank
    # 0's verdict code: the reference verdicts and the integrity checks beside them.
    passed = _verdict_of_rank0(_passed(comparisons, integrity) if comparisons is not None else None, world, device)
    located = None
    if spec.bisect and passed is False:
        with timer.stage("bisect"):
            # Fresh inputs: on the CPU the run above updated its (aliased) in-outs in place.
            fresh = (snapshot.load_rank(spec.golden_data, "in", in_names, grank, specs) if spec.golden_data
                     else layer.rank_inputs(case, grank))
            with implementation_contract(rank):
                walked = bisect.bisect_rank(layer, ctx, fresh, impl)
            check_harness_untouched(rank, "while bisect ran the implementation")
            merged = bisect.gather_bisect(ctx, walked)
            located = [None] * world if rank == 0 else None
            dist.gather_object(merged, located, dst=0)  # each group's rank 0 holds its group's report
            if rank == 0:
                located = [located[g * layout.tp] for g in range(layout.dp)]
    if rank != 0:
        return {"reporting": False, "passed": passed, "comparisons": None}
    return {
        "reporting": True,  # rank 0: compared and holds every rank's figures
        "passed": passed,
        "groups": [{"group": g, "ranks": layout.ranks_of(g), "seed": spec.case.of_group(g).seed,
                    "comparisons": comparisons[g] if comparisons is not None else None,
                    "integrity": integrity[g] if integrity is not None else None,
                    "bisect": located[g] if located is not None else None} for g in range(layout.dp)],
        "bench": bench_figures,
        "rank_seconds": [s["seconds"] for s in stats],
        "rank_cpu_seconds": [s["cpu_seconds"] for s in stats],
        "golden_cache_hits": [r for r, s in enumerate(stats) if s["golden_cache"] == "hit"],
        "input_cache_hits": [r for r, s in enumerate(stats) if s["inputs_cache"] == "hit"],
        "golden_cache_problems": sorted({s[k] for s in stats for k in ("golden_cache", "inputs_cache")
                                         if s[k] not in (None, "hit")}),
        "rank_peak_rss_mib": [s["peak_rss_mib"] for s in stats],
        "rank_cpus": [s["cpus"] for s in stats],  # each rank's CPU affinity
    }


def _verdict_of_rank0(verdict: bool | None, world: int, device) -> bool | None:
    """Rank 0's `verdict` on every rank (one byte: -1 None, 0 False, 1 True)."""
    code = torch.tensor([-1 if verdict is None else int(verdict)], dtype=torch.int8, device=device)
    if world > 1:
        dist.broadcast(code, src=0)
    return None if code.item() < 0 else bool(code.item())


def _passed(comparisons: list[dict], integrity: list[dict | None]) -> bool | None:
    """No reference check fails the run (a diagnostic one never does), no integrity check fails;
    None where no check counts (every one diagnostic, no integrity check): UNCHECKED on every node."""
    checks = [c for by_ref in integrity if by_ref is not None for cs in by_ref.values() for c in cs]
    verdicts = [v for by_ref in comparisons for vs in by_ref.values() for v in vs]
    if not checks and all(v.get("diagnostic") for v in verdicts):
        return None
    return not any(fails_the_run(v) for v in verdicts) and all(c["passed"] for c in checks)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (AttributeError, OSError):
        return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them for reuse), so that the resident
    set is what the process holds now. A no-op where malloc is not glibc's."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def _starts(stacked_inputs: dict, case) -> list | None:
    """Each rank's request start positions (the first position of every request)."""
    pos = stacked_inputs.get("position_ids")
    return pos.reshape(case.group_size, -1)[:, :: case.seq].tolist() if pos is not None else None
