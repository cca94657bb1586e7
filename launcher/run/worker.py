"""The per-rank entry point: build the rank's fixture slice, run the implementation, gather, judge.

Runs in every process the elastic agent starts (or under an external torchrun, which sets the
same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* environment). Phases, in order
(`launcher.config.rank_phases`):

    fixture -> golden -> [save] -> layer -> gather -> compare -> [bisect]

The golden of a rank's shard (the single-device layer on that rank's tensors with the full O
weights, spec validation.md §5.3) is computed on that rank, in parallel with the others, from
clones taken before the implementation is even imported (in the layer phase), with the same
thread count: the per-rank front of the layer is then bit-identical between golden and
implementation, and only the output half differs by fp32 summation order. Each of the layer's checks is judged whole on a rank of its
own (`launcher.run.judging`: every rank sends its shards of the check's tensors there), and
rank 0 collects the verdicts.
A rank's inputs and golden are read from the golden cache when its entries are whole
(`launcher.run.rank_data`). A golden that fails on any rank stops every rank before the
implementation runs. Nothing the golden or the judges run may have been replaced (a
monkey-patch, `launcher.run.golden_guard`): checked before the golden, after the implementation
is imported and built, and after each time it ran; a change is a contract error
(`launcher.run.impl_contract`).
With `golden_data` the inputs and the reference come from a snapshot (each rank reads its own
slice); `recompute_golden` adds the computed golden as a second reference.
Rank 0 returns the run's result (a plain dict) to the launcher; the other ranks return the
verdict rank 0 broadcast.
Any exception carries a note naming the rank and phase, and the elastic error file keeps its
traceback for the launcher's failure report.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import faulthandler
import functools
import json
import logging
import os
import resource
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from layers.contract.checks import PoolCheck
from layers.contract.context import RankContext
from layers.contract.tensors import Kind, tensor_sha256
from layers.distributed import wire

from launcher.config.fault_config import Fault
from launcher.config.rank_phases import RANK_PHASES
from launcher.config.spec import RunSpec
from launcher.config.verdict_words import run_passes
from launcher.run import (
    bench_rounds,
    bisect,
    devices,
    fault_injection,
    forkserver,
    golden_guard,
    judging,
    lifeline,
    nodes,
    watchdog,
)
from launcher.run.groups import GroupLayout, by_group, tp_process_group
from launcher.run.impl_contract import (
    check_harness_untouched,
    check_inputs_unchanged,
    check_outputs,
    implementation_contract,
    note_sigint,
)
from launcher.run.rank_data import cached_golden, rank_inputs
from launcher.store import snapshot
from launcher.verify.base import initial_key
from launcher.verify.integrity import golden_nonfinite

log = logging.getLogger("launcher.run.worker")


class GoldenNotFinite(RuntimeError):
    """The reference holds non-finite values where it must be finite: it cannot judge the run
    (a config whose math breaks down, or a damaged snapshot), so the run is an error, not a FAIL."""


def progress_path(output_dir: str, rank: int) -> str:
    """Where rank `rank` appends its phase events (JSON lines) for the launcher's progress display."""
    return os.path.join(output_dir, "progress", f"rank{rank}.jsonl")


class RankPhaseTimer:
    """The phases of this rank's run (`launcher.config.rank_phases`): times each (wall, and the
    CPU of every thread of this process: a phase whose wall far exceeds its CPU waited on a
    peer, a device or the disk), records its start and end as progress events, fires a
    configured fault at its start, and tags a failure with the rank and phase it happened in."""

    def __init__(self, rank: int, output_dir: str, fault: Fault | None = None):
        self.rank = rank
        self.fault = fault
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        path = progress_path(output_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._events = open(path, "a", buffering=1)

    def _event(self, name: str, event: str) -> None:
        self._events.write(json.dumps({"rank": self.rank, "phase": name, "event": event, "t": time.time()}) + "\n")

    @contextmanager
    def phase(self, name: str):
        assert name in RANK_PHASES, name
        t0, cpu0 = time.perf_counter(), time.process_time()
        log.info("phase %s ...", name)
        self._event(name, "start")
        try:
            fault_injection.at_phase_start(self.fault, name, self.rank)
            yield
        except BaseException as e:
            self._event(name, "failed")
            e.add_note(f"rank {self.rank} failed in phase '{name}' at t={time.time():.6f}")
            raise
        self.seconds[name] = time.perf_counter() - t0
        self.cpu_seconds[name] = time.process_time() - cpu0
        self._event(name, "done")
        log.info("phase %s done (%.2fs)", name, self.seconds[name])


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True
    )


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


@dataclasses.dataclass(frozen=True)
class RankJob:
    """What every phase of one rank's job reads: the run, this rank's place and its case's tensors."""

    spec: RunSpec
    layout: GroupLayout
    device: torch.device
    ctx: RankContext
    timer: RankPhaseTimer

    @property
    def case(self):
        return self.ctx.case

    @property
    def layer(self):
        return self.spec.layer

    @functools.cached_property
    def specs(self) -> dict:
        return self.layer.tensor_specs(self.case)

    @functools.cached_property
    def compared(self) -> list[str]:
        return self.layer.compared_names(self.case)

    @functools.cached_property
    def in_names(self) -> list[str]:
        return [n for n, s in self.specs.items() if s.kind is not Kind.OUTPUT]

    @functools.cached_property
    def pure(self) -> tuple[str, ...]:
        return self.layer.names_of(self.case, Kind.INPUT)


def _run(spec: RunSpec, layout: GroupLayout, group, device: torch.device):
    """One rank's run; `layout` places it in its TP group, `group` is that group's process
    group. The harness's gathers (a snapshot's to global rank 0, each compared tensor's to
    its judge) go over the world group. One function per phase; the tensors a phase no longer
    needs are dropped here, before the judges stack theirs."""
    case = spec.case.of_group(layout.group)
    ctx = RankContext(case=case, rank=layout.group_rank, device=device, group=group, global_rank=layout.rank,
                      group_index=layout.group)
    job = RankJob(spec, layout, device, ctx, RankPhaseTimer(layout.rank, spec.output_dir, spec.fault))
    inputs, input_digests, wo_full, inputs_cache = _fixture_phase(job)
    # Every reference is made before the implementation is imported, from clones of the inputs:
    # nothing its module, constructor or call does can reach it.
    references, cache_status, context = _golden_phase(job, inputs, wo_full) if spec.golden else ({}, None, {})
    del wo_full
    if spec.save_data:
        _save_phase(job, inputs, references)
    impl, tensors, pristine, outputs = _layer_phase(job, inputs, input_digests)
    if not spec.bench:
        del tensors  # what the outputs do not alias is freed before the judges stack
    del inputs
    held = _gather_phase(job, outputs, references, context)
    del outputs, context
    bench_figures = None
    if spec.bench:
        bench_figures = _bench_phase(job, impl, tensors, pristine)
        del tensors, pristine
    judged = []
    if spec.golden:
        judged = _compare_phase(job, held)
    del held
    stats, comparisons, integrity = _collect_figures(job, cache_status, inputs_cache, judged, list(references))
    # Every rank learns the verdict (None: nothing was compared), so every node exits with rank
    # 0's verdict code: the reference verdicts and the integrity checks beside them.
    passed = _verdict_of_rank0(_passed(comparisons, integrity) if comparisons is not None else None,
                               layout.world, device)
    located = _bisect_phase(job, impl) if spec.bisect and passed is False else None
    return _rank_result(job, passed, comparisons, integrity, located, bench_figures, stats)


def _fixture_phase(job: RankJob):
    """This rank's inputs (a snapshot's slice, or drawn / read from the golden cache) and the
    sha256 of its pure inputs; the full O weights and the inputs' cache status where drawn."""
    spec, grank = job.spec, job.layout.group_rank
    with job.timer.phase("fixture"):
        check_harness_untouched(job.layout.rank, "before this job's golden (by an implementation imported before "
                                                 "it: an earlier job's on this warm rank, or this one's by the "
                                                 "preflight of this process or of the one it was forked from)")
        if spec.golden_data:
            inputs = snapshot.load_rank(spec.golden_data, "in", job.in_names, grank, job.specs)
            return inputs, {n: tensor_sha256(inputs[n]) for n in job.pure}, None, None
        made = rank_inputs(spec, job.layer, job.case, grank, job.pure,
                           stores_group=job.layout.leads_group_on(node_ranks(spec)), ctx=job.ctx)
        return made.tensors, made.sha256, made.wo_full, made.cache


def _golden_phase(job: RankJob, inputs: dict, wo_full):
    """The references (the snapshot's, the computed golden or both), checked finite, and the
    context the judges need (mapping tensors, the in-outs' initial values). A golden that
    fails on any rank stops every rank here."""
    spec, layer, case, rank = job.spec, job.layer, job.case, job.layout.rank
    references, cache_status, context = {}, None, {}
    failure = None
    try:
        with job.timer.phase("golden"):
            if spec.golden_data:
                references["snapshot"] = snapshot.load_rank(spec.golden_data, "out", job.compared,
                                                            job.layout.group_rank, job.specs)
            if not spec.golden_data or spec.recompute_golden:
                references["golden"], cache_status = cached_golden(spec, layer, job.ctx, inputs, wo_full)
            for source, reference in references.items():
                check_reference_finite(spec, case, layer, source, reference, inputs, rank,
                                       cached=source == "golden" and cache_status == "hit")
            mappings = sorted({c.mapping for c in layer.checks(case) if isinstance(c, PoolCheck)})
            context = {n: inputs[n].clone() for n in mappings}
            inout = [n for n in job.compared if job.specs[n].kind is Kind.INOUT]
            context.update({initial_key(n): inputs[n].clone() for n in inout})
    except Exception as e:  # raised once every rank has heard of it
        failure = e
    stop_unless_every_reference_was_made(failure, rank, job.layout.world, job.device)
    return references, cache_status, context


def _save_phase(job: RankJob, inputs: dict, references: dict) -> None:
    """Every group's inputs and reference outputs, stacked on global rank 0, saved as snapshots."""
    spec, layout, rank = job.spec, job.layout, job.layout.rank
    with job.timer.phase("save"):
        stacked_in = gather_to_rank0(inputs, job.in_names, rank, layout.world, job.device)
        stacked_out = gather_to_rank0(next(iter(references.values())), job.compared, rank, layout.world, job.device)
        if rank == 0:
            for g, (ins, outs) in enumerate(zip(by_group(stacked_in, layout), by_group(stacked_out, layout))):
                folder = spec.save_data if layout.dp == 1 else os.path.join(spec.save_data, f"group{g}")
                group_case = spec.case.of_group(g)
                snapshot.save(folder, group_case, job.specs, ins, outs, _starts(ins, group_case))


def _layer_phase(job: RankJob, inputs: dict, input_digests: dict):
    """The implementation imported, built and called once on this rank's tensors; its outputs
    checked against the contract. Returns the implementation, the tensors it was called on,
    the in-outs' values before the step (for the benchmark) and its outputs."""
    spec, rank, specs = job.spec, job.layout.rank, job.specs
    with job.timer.phase("layer"):
        with implementation_contract(rank):
            impl = instantiate(spec.impl)
        check_harness_untouched(rank, "on import or construction of the implementation")
        tensors = {n: t.to(job.device) for n, t in inputs.items()}
        # The benchmark restores the in-out tensors to their values before the step.
        pristine = {n: t.clone() for n, t in tensors.items() if specs[n].kind is Kind.INOUT} if spec.bench else {}
        pure_tensors = {n: tensors[n] for n in job.pure}  # the implementation may rebind the dict's entries
        with implementation_contract(rank):
            outputs = impl(job.ctx, tensors)
        check_harness_untouched(rank, "while the implementation ran")
        # An output fault hits the layer's output (x_out, x_next), a focused scope's first in-out.
        fault_injection.on_outputs(spec.fault, rank, outputs,
                                   (job.layer.names_of(job.case, Kind.OUTPUT) or job.compared)[0], job.case.seq)
        check_outputs(outputs, {n: specs[n] for n in job.compared}, rank)
        check_inputs_unchanged(pure_tensors, input_digests, rank)
    return impl, tensors, pristine, outputs


def _gather_phase(job: RankJob, outputs: dict, references: dict, context: dict) -> dict:
    """Each compared tensor's shards (outputs, references, context) sent to the rank that judges it."""
    with job.timer.phase("gather"):
        release_freed_memory()  # glibc keeps freed heap resident; the stacks are new mappings
        if not references:
            return {}
        world = job.layout.world
        assignments = judging.plan(job.layer.checks(job.case), context, job.specs, len(references), world)
        return judging.send_to_judges(assignments, outputs, references, context, job.layout.rank, world, job.device)


def _bench_phase(job: RankJob, impl, tensors: dict, pristine: dict) -> dict | None:
    """The benchmark's timed rounds on every rank; rank 0 returns their summary."""
    spec, rank, world = job.spec, job.layout.rank, job.layout.world
    with job.timer.phase("bench"):
        trace = os.path.join(spec.output_dir, "profile", f"rank{rank}.json") if spec.bench.profile else None
        if trace:
            os.makedirs(os.path.dirname(trace), exist_ok=True)
        times = bench_rounds.run_rounds(impl, job.ctx, tensors, pristine, spec.bench, trace)
        check_harness_untouched(rank, "while the benchmark ran the implementation")
        every = [None] * world if rank == 0 else None
        dist.gather_object(times, every, dst=0)
        if rank != 0:
            return None
        figures = bench_rounds.summarize(spec.bench, every)
        if trace:
            figures["profiles"] = [os.path.join("profile", f"rank{r}.json") for r in range(world)]
        return figures


def _compare_phase(job: RankJob, held: dict) -> list:
    """The verdicts of the checks this rank judges."""
    spec, layout = job.spec, job.layout
    with job.timer.phase("compare"):
        cases = [spec.case.of_group(g) for g in range(layout.dp)]
        return judging.judge(held, cases, job.layer.checks, spec.tolerances, layout, spec.integrity)


def _collect_figures(job: RankJob, cache_status, inputs_cache, judged: list, sources: list[str]):
    """Every rank's figures and verdicts on rank 0: (stats, comparisons, integrity), the last two
    by group ({reference: verdicts}, {reference: checks}); None off rank 0 or where nothing was compared."""
    spec, rank, world = job.spec, job.layout.rank, job.layout.world
    stats = [None] * world if rank == 0 else None
    dist.gather_object({"seconds": job.timer.seconds, "cpu_seconds": job.timer.cpu_seconds,
                        "golden_cache": cache_status, "inputs_cache": inputs_cache, "peak_rss_mib": peak_rss_mib(),
                        "cpus": devices.cpu_affinity(), "judged": judged},
                       stats, dst=0)
    if rank != 0 or not spec.golden:
        return stats, None, None
    comparisons, integrity = judging.collect([s.pop("judged") for s in stats], job.layout.dp, sources, spec.integrity)
    return stats, comparisons, integrity


def _bisect_phase(job: RankJob, impl) -> list | None:
    """A failing run re-run stage by stage (`launcher.run.bisect`); rank 0 returns each group's report."""
    spec, layout, rank = job.spec, job.layout, job.layout.rank
    with job.timer.phase("bisect"):
        # Fresh inputs: on the CPU the run above updated its (aliased) in-outs in place.
        fresh = (snapshot.load_rank(spec.golden_data, "in", job.in_names, layout.group_rank, job.specs)
                 if spec.golden_data else job.layer.rank_inputs(job.case, layout.group_rank))
        with implementation_contract(rank):
            walked = bisect.bisect_rank(job.layer, job.ctx, fresh, impl)
        check_harness_untouched(rank, "while bisect ran the implementation")
        merged = bisect.gather_bisect(job.ctx, walked)
        located = [None] * layout.world if rank == 0 else None
        dist.gather_object(merged, located, dst=0)  # each group's rank 0 holds its group's report
        return [located[g * layout.tp] for g in range(layout.dp)] if rank == 0 else None


def _rank_result(job: RankJob, passed, comparisons, integrity, located, bench_figures, stats) -> dict:
    """What this rank returns to the launcher: rank 0 the run's figures, the others the verdict."""
    spec, layout = job.spec, job.layout
    if layout.rank != 0:
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
    """The run's verdict over every group (`run_passes`; None: UNCHECKED on every node)."""
    checks = [c for by_ref in integrity if by_ref is not None for cs in by_ref.values() for c in cs]
    return run_passes([v for by_ref in comparisons for vs in by_ref.values() for v in vs], checks)


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
