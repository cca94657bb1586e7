"""The one reader of the run config: a composed Hydra config -> a validated, frozen `RunSpec`.

`run_spec` reads every key once and checks each value (naming the key, the value and the
rule) into a RunSpec and its case (the class its layer and phase build, `layers.registry.case_type`,
from the config keys: `from_config`); `validated_spec` takes the case a replayed
snapshot fixes (`launcher.config.replay`), validates the case once (its TP or EP rules, then
its layer's) and reads the run's tolerances (`launcher.config.tolerance`). What only the
machine can tell (devices, ports, the snapshot's files, an importable implementation) is
checked next by `launcher.run.preflight`. `check_config` is what needs no layer's compute (a
run's first check, before torch is imported). `config_case` is the same config's case for a
run refused before a RunSpec exists, each key read on its own.

RunSpec is plain dataclasses, picklable, no OmegaConf: it is what every rank receives.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig, OmegaConf

from layers.contract.config import ConfigError, ModelConfig
from layers.registry import (PHASE_CASES, PHASES, AnyCase, case_type, check_case, check_scope, layer_of, validated,
                             whole_requests)

from launcher.config.fault_config import Fault
from launcher.config.fault_config import check_unset as check_fault_unset
from launcher.config.job_slot import JobSlot
from launcher.config.overrides import foreign_case_key, override_keys
from launcher.config.replay import (SnapshotFacts, facts_entry, given_keys, replayed_case, replayed_layer,
                                    replayed_phase)
from launcher.config.schema import RunSchema, layer_groups, layer_keys, with_layer
from launcher.config.slurm import node_keys, slurm_step
from launcher.config.tolerance import Tolerances, read_tolerances

if TYPE_CHECKING:
    from layers.contract.layer import Layer

BACKENDS = ("auto", "gloo", "nccl", "hccl")
START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_IMPL = "layers.tp.TorchTP"


@dataclass(frozen=True)
class BenchSpec:
    """Benchmark mode (`launcher.run.bench_rounds`): timed rounds after the validated step."""

    rounds: int
    warmup: int = 0
    stages: bool = False  # time every stage of a stage-based implementation
    profile: bool = False  # torch.profiler traces of the timed rounds, one per rank


def usable_cpus() -> int:
    """The CPUs this process may run on; the machine's count where affinity is unknown."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to run its part of one case, and how the launcher reports it
    (picklable, no OmegaConf)."""

    case: AnyCase
    impl: dict  # a Hydra instantiate spec: {"_target_": ..., **kwargs}
    backend: str
    timeout_s: float
    start_method: str
    threads_per_rank: Optional[int]
    output_dir: str
    golden_data: Optional[str] = None  # replay: inputs and reference outputs from this snapshot
    save_data: Optional[str] = None  # write this run's inputs and golden outputs as a snapshot
    save_overwrite: bool = False  # save_data may replace the snapshot a folder holds
    snapshot: Optional[dict] = None  # replay: the case keys read from golden_data, with their files
    tolerances: Tolerances = Tolerances()  # what the tolerance config sets for this case's checks
    recompute_golden: bool = False  # with golden_data: also compare against a recomputed golden
    golden_cache: Optional[str] = None  # folder of cached goldens; None disables the cache
    golden_cache_max_bytes: Optional[int] = None  # the cache's size cap (LRU eviction); None = no cap
    fault: Optional[Fault] = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 (single node): the store binds a free port
    nproc_per_node: int = 0  # ranks on this node; 0 means dp * tp / nnodes
    bisect: bool = False  # after a failing full run, locate the first divergent stage and rank
    report_plots: bool = False  # PNG heat maps of a failing tensor's errors (drawn by the launcher)
    dp: int = 1  # TP groups side by side: the world is dp * tp ranks (launcher.run.groups)
    golden: bool = True  # False: a performance-only run, no golden and no comparison (UNCHECKED)
    bench: Optional[BenchSpec] = None  # benchmark rounds after the validated step
    integrity: bool = True  # the integrity checks beside the reference comparators also judge the run
    slot: Optional[JobSlot] = None  # a sweep job run beside others on this node: its cores and devices
    warm_ranks: bool = True  # single node: a job that passed leaves its rank processes to the next job

    @property
    def layer(self) -> Layer:
        """The layer (or focused scope) the case runs, this process's own instance."""
        return layer_of(self.case)

    @property
    def world(self) -> int:
        """Every rank of the launch: dp groups of the layer's group size (tp, or ep)."""
        return self.dp * self.case.group_size

    @property
    def local_ranks(self) -> int:
        return self.nproc_per_node or self.world // self.nnodes

    @property
    def rank_base(self) -> int:
        """Global rank of this node's first rank: node 0 holds rank 0, which compares."""
        return self.node_rank * self.local_ranks

    @property
    def deadline_s(self) -> float:
        """Wall-clock limit of one rank: a rank still running then dumps its stacks and exits."""
        return 2 * self.timeout_s

    def threads(self) -> int:
        """Per-rank intra-op threads: the cores this process may run on (taskset, a cpuset,
        Slurm's --cpus-per-task), or its job slot's, shared by its ranks, never oversubscribed."""
        if self.threads_per_rank:
            return self.threads_per_rank
        cpus = len(self.slot.cpus) if self.slot is not None else usable_cpus()
        return max(1, cpus // self.local_ranks)

    def case_entry(self) -> dict:
        """result.json's `case`: what ran, as the config names it; a MoE case's `num_tokens`
        as the count that ran (null in the config: all T tokens per rank); and, where the case
        states it (`beyond_reference()`), what about it the reference's kernels would refuse."""
        case = self.case.describe()
        if "num_tokens" in case:
            case["num_tokens"] = self.case.active
        beyond = getattr(self.case, "beyond_reference", list)()
        return {**case, "model": self.case.model.name, "dp": self.dp, "backend": self.backend,
                "impl": self.impl.get("_target_"), **({"beyond_reference": beyond} if beyond else {})}


def run_spec(cfg: DictConfig, output_dir: str) -> RunSpec:
    """Every key of a composed config read once and its value checked, into a RunSpec; raises
    ConfigError naming the key, its value and the rule. The case it holds is not validated yet:
    `validated_spec` does that, once.
    """
    model_fields = OmegaConf.to_container(cfg.model, resolve=True)
    model = ModelConfig(**model_fields)
    layer_name, scope = str(cfg.layer.name), str(cfg.scope)
    check_scope(layer_name, scope)  # an unknown layer or scope is a ConfigError here
    case = _case(cfg, model, layer_name, scope)
    group = case.group_size
    dp = int(cfg.dp)
    if dp < 1:
        raise ConfigError(f"dp={dp} must be >= 1 (the number of groups; the world is dp*{case.group_key} ranks)")
    if dp > 1 and cfg.golden_data:
        raise ConfigError(f"golden_data replays one group's snapshot: it needs dp=1, not dp={dp}")
    world = dp * group
    if cfg.bisect and scope != "full":
        raise ConfigError(f"bisect=true locates a divergent stage of the full layer; it needs scope=full, not scope={scope}")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"backend={cfg.backend!r} must be one of {', '.join(BACKENDS)}")
    if cfg.start_method not in START_METHODS:
        raise ConfigError(f"start_method={cfg.start_method!r} must be one of {', '.join(START_METHODS)}")
    timeout_s = default_timeout_s(model) if cfg.timeout_s is None else float(cfg.timeout_s)
    if not (math.isfinite(timeout_s) and timeout_s >= 1):  # the rendezvous counts whole seconds
        raise ConfigError(f"timeout_s={cfg.timeout_s} must be a finite number of seconds >= 1")
    golden, bench = _performance(cfg)
    fault = None
    if cfg.fault.kind is not None:
        fault = Fault(kind=str(cfg.fault.kind), rank=int(cfg.fault.rank), phase=str(cfg.fault.phase))
        fault.check(world, _absent_phases(cfg, golden, bench))
    else:
        check_fault_unset(int(cfg.fault.rank), str(cfg.fault.phase), world)
    if cfg.threads_per_rank is not None and cfg.threads_per_rank < 1:
        raise ConfigError(f"threads_per_rank={cfg.threads_per_rank} must be >= 1")
    if cfg.recompute_golden and not cfg.golden_data:
        raise ConfigError("recompute_golden=true needs golden_data=DIR (there is nothing else to recompute against)")
    if cfg.impl is None:
        impl = {"_target_": DEFAULT_IMPL}
    elif isinstance(cfg.impl, str):  # the shorthand impl=package.module.Name
        impl = {"_target_": cfg.impl}
    else:
        impl = OmegaConf.to_container(cfg.impl, resolve=True)
    if not isinstance(impl, dict) or "_target_" not in impl:
        raise ConfigError(f"impl={impl!r} must name a callable as impl._target_=package.module.Name")
    return RunSpec(
        case=case,
        impl=impl,
        backend=str(cfg.backend),
        timeout_s=timeout_s,
        start_method=str(cfg.start_method),
        threads_per_rank=cfg.threads_per_rank,
        output_dir=output_dir,
        golden_data=_path(cfg.golden_data),
        save_data=_path(cfg.save_data),
        save_overwrite=bool(cfg.save_overwrite),
        recompute_golden=bool(cfg.recompute_golden),
        golden_cache=_path(cfg.golden_cache),
        golden_cache_max_bytes=_cache_cap(cfg.golden_cache_max_gb),
        fault=fault,
        bisect=bool(cfg.bisect),
        report_plots=bool(cfg.report.plots),
        integrity=bool(cfg.integrity),
        warm_ranks=bool(cfg.warm_ranks),
        dp=dp,
        golden=golden,
        bench=bench,
        **_nodes(cfg, case, dp),
    )


def _case(cfg: DictConfig, model: ModelConfig, layer: str, scope: str):
    """The case the run's layer and phase build from the config keys (`layers.registry.case_type`).
    A phase with a case of its own takes only its keys (the layer's group at its defaults); the
    other phases refuse them."""
    group = layer_groups()[layer]
    kind = case_type(layer, str(cfg.phase), group["key_set"])
    own = getattr(kind, "config_keys", ())
    if own:
        decode_keys = [k for k, default in group["keys"].items() if cfg[k] != default]
        if decode_keys:
            raise ConfigError(f"{decode_keys[0]}={cfg[decode_keys[0]]} is a key of phase={PHASES[0]}; "
                              f"phase={cfg.phase} takes {', '.join(own[:-1])} and {own[-1]}")
    for phase, other in PHASE_CASES.items():
        given = [k for k in other.config_keys if phase != cfg.phase and cfg[k] != _RUN_DEFAULTS[k]]
        if given:
            raise ConfigError(f"{given[0]}={cfg[given[0]]} is a key of phase={phase}; leave it out of a "
                              f"{cfg.phase} run")
    return kind.from_config(cfg, model, layer, scope, whole_requests(layer, scope))


# The run config's own defaults (RunSchema), against which a phase's keys count as given.
_RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSchema) if f.default is not dataclasses.MISSING}


def check_config(cfg: DictConfig) -> RunSpec | None:
    """What `validated_spec` refuses without a layer's compute (torch-free): every key's value
    and the case's own rules (`layers.registry.check_case`), so that such a refusal imports no
    torch; the RunSpec so read (to show, not to run: no output folder, no tolerances), or None
    for a replay, whose case is its snapshot's, read by `validated_spec`: only the keys that
    cannot go together are checked here."""
    _performance(cfg)
    if cfg.golden_data:
        return None
    spec = run_spec(cfg, os.devnull)
    check_case(spec.case)
    return spec


def validated_spec(cfg: DictConfig, output_dir: str, *, overrides: Sequence[str] | None = None,
                   describe_snapshot: Callable[[str], SnapshotFacts] | None = None) -> RunSpec:
    """The one reader's whole answer: `run_spec`, the case a replayed snapshot fixes, and the
    case validated once (its TP or EP rules, then its layer's).

    `overrides`: the run's override strings, which say what the user gave explicitly (None:
    every key as composed) and whose tolerance entries win over a profile's.
    `describe_snapshot(golden_data)` reads what a snapshot says of its case
    (`launcher.store.snapshot_case.describe`): the config floor opens no snapshot itself. The
    snapshot's layer is read first, since it decides which keys the case takes.
    """
    _performance(cfg)  # keys that cannot go together are refused before any snapshot is read
    given = given_keys(cfg, overrides)
    facts = None
    # A replay is of one group: with dp != 1, run_spec refuses it before any file is read.
    if cfg.golden_data and describe_snapshot is not None and int(cfg.dp) == 1:
        facts = describe_snapshot(_path(cfg.golden_data))
        # The snapshot's layer decides which keys the case takes (tp or ep): read it first.
        layer = replayed_layer(str(cfg.layer.name), facts, given)
        phase = replayed_phase(str(cfg.phase), facts, given)
        if layer != cfg.layer.name:  # the snapshot's layer's keys, not the config's layer's
            refusal = foreign_case_key(list(overrides or ()), layer_keys(), layer)
            if refusal is not None:
                raise ConfigError(f"{refusal} (the layer of golden_data)")
            cfg = with_layer(cfg, layer)
        if phase != cfg.phase:
            cfg = OmegaConf.merge(cfg, {"phase": phase})
    spec = run_spec(cfg, output_dir)
    if facts is not None:
        case, read = replayed_case(spec.case, facts, given)
        spec = dataclasses.replace(spec, case=case, snapshot=facts_entry(facts, read), **_nodes(cfg, case, spec.dp))
        if spec.fault is not None:  # its rank against the snapshot's group, not the config's
            spec.fault.check(spec.world, _absent_phases(cfg, spec.golden, spec.bench))
    validated(spec.case)  # the one validation of a case: its TP rules, then its layer's
    explicit = override_keys(overrides) if overrides is not None else frozenset()
    return dataclasses.replace(spec, tolerances=read_tolerances(cfg.get("tolerance"), spec.case, explicit))


def _performance(cfg: DictConfig) -> tuple[bool, Optional[BenchSpec]]:
    """`golden` and the benchmark: golden=false skips golden and comparison (a performance run
    of a case already validated), so it cannot be replayed against, saved or bisected."""
    rounds, warmup = int(cfg.bench.rounds), int(cfg.bench.warmup)
    if rounds < 0 or warmup < 0:
        raise ConfigError(f"bench.rounds={rounds} and bench.warmup={warmup} must be >= 0")
    if rounds == 0 and (warmup or cfg.bench.stages or cfg.profile):
        given = "bench.warmup" if warmup else "bench.stages=true" if cfg.bench.stages else "profile=true"
        raise ConfigError(f"{given} applies to benchmark rounds: set bench.rounds=N (N > 0)")
    golden = bool(cfg.golden)
    if not golden:
        for key in ("golden_data", "save_data"):
            if cfg[key]:
                raise ConfigError(f"golden=false runs no golden: it cannot go with {key}={cfg[key]}")
        if cfg.bisect:
            raise ConfigError("golden=false runs no golden: bisect=true has nothing to compare against")
    bench = BenchSpec(rounds, warmup, bool(cfg.bench.stages), bool(cfg.profile)) if rounds else None
    return golden, bench


def _absent_phases(cfg: DictConfig, golden: bool, bench: Optional[BenchSpec]) -> dict[str, str]:
    """The rank phases this run will not have, each with the key that would add it."""
    absent = {}
    if not cfg.save_data:
        absent["save"] = "save_data=DIR"
    if bench is None:
        absent["bench"] = "bench.rounds=N"
    if not golden:
        absent.update(golden="golden=true", compare="golden=true")
    return absent


def _nodes(cfg: DictConfig, case, dp: int) -> dict:
    # Under srun the step's own nodes fill the keys not given (launcher.config.slurm); a task
    # that already has a RANK is one rank of an external launcher (launcher.torchrun).
    keys = node_keys(cfg, slurm_step(os.environ), task_is_rank="RANK" in os.environ)
    nnodes, node_rank = int(keys["nnodes"]), int(keys["node_rank"])
    size, key = case.group_size, case.group_key
    world = dp * size
    if nnodes < 1:
        raise ConfigError(f"nnodes={nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node_rank={node_rank} must be in [0, {nnodes}) for nnodes={nnodes}")
    nproc = int(cfg.nproc_per_node) if cfg.nproc_per_node is not None else (world // nnodes if world % nnodes == 0 else 0)
    if nproc < 1 or nproc * nnodes != world:
        ranks = f"dp*{key}={dp}*{size}={world}" if dp > 1 else f"{key}={size}"
        raise ConfigError(
            f"nproc_per_node={cfg.nproc_per_node if cfg.nproc_per_node is not None else 'world/nnodes'} x "
            f"nnodes={nnodes} must equal {ranks} (one rank per device on every node)"
        )
    port = keys["master_port"] if keys["master_port"] is not None else (0 if nnodes == 1 else 29500)
    if not 0 <= int(port) < 65536 or (nnodes > 1 and int(port) == 0):
        raise ConfigError(f"master_port={port} must be a TCP port in [1, 65535] for a multi-node run")
    return {"nnodes": nnodes, "node_rank": node_rank, "master_addr": str(keys["master_addr"]),
            "master_port": int(port), "nproc_per_node": nproc}


def default_timeout_s(model: ModelConfig) -> float:
    """Collective timeout when none is given: a hang at small dims ends in well under a minute,
    while a flash-dims rank may legitimately wait on slower peers for a while."""
    return 20.0 if model.hidden_size <= 1024 else 300.0


def _path(value: Optional[str]) -> Optional[str]:
    return os.path.abspath(os.path.expanduser(str(value))) if value else None


def golden_cache_of(cfg: DictConfig) -> tuple[Optional[str], Optional[int]]:
    """The golden cache folder and its cap in bytes, read as `run_spec` reads them (for a
    sweep's end, which has no RunSpec)."""
    return _path(cfg.golden_cache), _cache_cap(cfg.golden_cache_max_gb)


def _cache_cap(gb: Optional[float]) -> Optional[int]:
    """golden_cache_max_gb in bytes (GB = 10^9 bytes, as `du --si` shows it)."""
    if gb is None:
        return None
    if not gb > 0:
        raise ConfigError(f"golden_cache_max_gb={gb} must be > 0 (null: no cap; golden_cache=null: no cache)")
    return int(gb * 1e9)


# -- the case of a run refused before a RunSpec exists --------------------------------------------


def config_case(cfg) -> dict:
    """The case as the config states it, for a run refused before a RunSpec exists.

    Each key separately: one value that cannot be read (a bad interpolation) must not hide
    the others.
    """

    def get(read):
        try:
            v = read()
        except Exception:  # any unreadable value: the preflight message says why
            return None
        return list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v

    return {
        "layer": get(lambda: cfg.layer.name),
        "scope": get(lambda: cfg.scope),
        "model": get(lambda: cfg.model.name),
        "tp": get(lambda: cfg.tp),
        "ep": get(lambda: cfg.ep),
        "dp": get(lambda: cfg.dp),
        "local_t": get(lambda: cfg.local_t),
        "seed": get(lambda: cfg.seed),
        "start_pos": get(lambda: cfg.start_pos),
        "backend": get(lambda: cfg.backend),
        "impl": get(lambda: cfg.impl["_target_"]),
    }
